"""Shipped code (issue 13): ``trainyard run`` packs a job file's ``workdir`` into a tar.gz, uploads
it once per content hash, and names it in the job; each node's agent fetches it through the
control plane (``GET /v1/agent/attempts/{id}/code``, fenced: only a node of a live attempt of that
job gets it), checks its sha256 and unpacks it into the attempt's directory.

Archives are content-addressed per tenant, ``code/<tenant>/<sha256>.tar.gz`` in the checkpoint
bucket: a resubmit of unchanged code uploads nothing, and a tenant cannot run another tenant's code
by guessing its hash."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane import authz
from control_plane.authz import Principal
from control_plane.errors import Forbidden, NotFound, StaleAttempt, TrainyardError, Unprocessable
from control_plane.models import Attempt, AttemptPart, Job, Node
from control_plane.services.states import ATTEMPT_LIVE


class NoStorage(TrainyardError):
    """Code shipping needs the object store, and this control plane has none."""

    status = 422
    slug = "no-object-store"


def code_key(tenant: str, sha256: str) -> str:
    return f"code/{tenant}/{sha256}.tar.gz"


def require_store(store: Any) -> Any:
    if store is None:
        raise NoStorage("code shipping needs S3 (TRAINYARD_S3_ENDPOINT): install the code on the nodes instead")
    return store


def find(store: Any, tenant: str, sha256: str) -> dict[str, Any] | None:
    """The archive's reference when it was uploaded for ``tenant``."""
    info = require_store(store).stat(code_key(tenant, sha256))
    return None if info is None else {"sha256": sha256, "size_bytes": int(info.size)}


def owner_tenant(principal: Principal, tenant: str | None) -> str:
    """The caller's tenant; an admin may name another (as when submitting on a team's behalf)."""
    try:
        return authz.submit_tenant(principal, tenant)
    except ValueError as exc:
        raise Forbidden(str(exc)) from exc


def get(store: Any, principal: Principal, sha256: str, tenant: str | None = None) -> dict[str, Any]:
    owner = owner_tenant(principal, tenant)
    found = find(store, owner, sha256)
    if found is None:
        raise NotFound(f"no code {sha256} uploaded for tenant {owner}")
    return found


def for_job(store: Any, tenant: str, sha256: str) -> dict[str, Any]:
    """At submit, before the job's transaction: the code must have been uploaded for its tenant."""
    found = find(store, tenant, sha256)
    if found is None:
        raise Unprocessable(f"code {sha256} was not uploaded for tenant {tenant} (PUT /v1/code/{sha256} first; "
                            "trainyard run does it)", field="code")
    return found


def fetch_for_node(session: Session, node: Node, attempt_id: uuid.UUID, store: Any) -> tuple[Iterator[bytes], str]:
    """The archive of a live attempt's job, for a node that runs a part of it: (its bytes, a chunk
    at a time as S3 sends them, never the whole archive in memory; its sha256)."""
    row = session.execute(
        select(Job.tenant, Job.code).join(Attempt, Attempt.job_id == Job.id)
        .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
        .where(Attempt.id == attempt_id, AttemptPart.node_id == node.id, Attempt.state.in_(ATTEMPT_LIVE))
    ).one_or_none()
    session.rollback()  # no transaction held across the download below
    if row is None:
        raise StaleAttempt(f"attempt {attempt_id} is not a live attempt of node {node.name}")
    tenant, code = row
    if not code:
        raise NotFound(f"the job of attempt {attempt_id} ships no code")
    body = require_store(store).get_object(code_key(tenant, code["sha256"]))  # opened here: errors come before 200
    return _chunks(body), str(code["sha256"])


def _chunks(body: Any, size: int = 2**20) -> Iterator[bytes]:
    try:
        while chunk := body.read(size):
            yield chunk
    finally:
        body.close()
        release = getattr(body, "release_conn", None)
        if release:
            release()
