"""Storage grants: presigned URLs for exactly the checkpoint objects a worker may touch
(trainyard/protocol/grants.py says what; docs/security.md, "Checkpoint storage", why).

Workers hold no storage credential. Every URL is for one object and one method, expires after
``storage_grant_ttl_s``, and is signed here with the credentials only the control plane holds. A PUT also signs its
``Content-Length``: the size granted, bounded by storage_bounds.py, is the only size S3 accepts.
The key is never taken from the request as is: it must parse as exactly the key the layout gives
(trainyard.protocol.keys.parse_key), so nothing outside the job's prefix, and no ``..``, is ever
signed. PUT URLs sign ``If-None-Match: *``: S3 refuses to overwrite any object with them, so a
shard once written (and a checkpoint once committed) cannot be changed through a grant.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import Conflict, Forbidden, NotFound, TrainyardError, Unprocessable
from control_plane.models import Attempt, Checkpoint, CheckpointShard, Job, Node
from control_plane.services.checkpoints import storage_bounds
from control_plane.services.runs.fencing import authorize_report
from control_plane.settings import Settings
from trainyard.protocol import keys
from trainyard.protocol.grants import (
    MAX_PARTS,
    GrantAction,
    StorageAnswer,
    StorageBatchAnswer,
    StorageBatchRequest,
    StorageGrant,
    StorageGrants,
    StorageItem,
    StorageRequest,
)

Asked = StorageRequest | StorageItem
"""One request for grants: on its own, or one of a batch's."""
CREATE_ONLY = {"If-None-Match": "*"}
"""Signed into every URL that creates an object: S3 answers 412 instead of overwriting one."""
READABLE = ("committed", "unusable")
"""Checkpoint states whose objects a restore may read (an unusable one is still in storage; a
restore that fell back from it has already read it)."""


class Signer(Protocol):
    """What signs URLs (trainyard.storage.s3.S3Storage.presign)."""

    def presign(self, method: str, key: str, *, expires_s: int, headers: dict[str, str] | None = None,
                query: dict[str, str] | None = None, now: datetime | None = None) -> str: ...


class StorageUnavailable(Conflict):
    """This control plane has no checkpoint storage."""

    slug = "no-storage"


def grant(session: Session, node: Node, attempt_id: uuid.UUID, req: StorageRequest, signer: Signer | None,
          settings: Settings) -> StorageGrants:
    """The URLs ``req`` may have, for a worker of ``node``'s part of the attempt; raises a domain
    error (403, 404, 409, 422) for anything else. Reads only; ends its transaction before signing."""
    signer = _storage(signer)
    job, attempt, _part = authorize_report(session, node, attempt_id, req.fencing_token, req.node_rank,
                                           exclusive=False)
    sign = _checked(session, job, attempt, req, settings)
    session.commit()
    return sign(signer)


def grant_batch(session: Session, node: Node, attempt_id: uuid.UUID, req: StorageBatchRequest,
                signer: Signer | None, settings: Settings) -> StorageBatchAnswer:
    """``grant`` for each of a batch's requests, fenced once and checked in one transaction: each
    answered as the single path would (200 and its grants, or the status and detail of its
    refusal), in order. Only a fencing failure (409, 403 for another node's part) or a control plane
    without storage refuses the whole batch."""
    signer = _storage(signer)
    job, attempt, _part = authorize_report(session, node, attempt_id, req.fencing_token, req.node_rank,
                                           exclusive=False)
    checked: list[Callable[[Signer], StorageGrants] | TrainyardError] = []
    for item in req.requests:
        try:
            # Every refusal is raised before the item writes anything (storage_bounds.record is its
            # last step, and refuses before it writes): a refused item leaves the transaction as it was.
            checked.append(_checked(session, job, attempt, item, settings))
        except TrainyardError as exc:
            checked.append(exc)
    session.commit()
    answers = []
    for outcome in checked:
        if isinstance(outcome, TrainyardError):
            answers.append(_refused(outcome))
            continue
        try:
            answers.append(StorageAnswer(status=200, grants=outcome(signer)))
        except TrainyardError as exc:
            answers.append(_refused(exc))
    return StorageBatchAnswer(answers=answers)


def _refused(exc: TrainyardError) -> StorageAnswer:
    problem = exc.problem()
    return StorageAnswer(status=exc.status, detail=exc.detail, type=problem["type"])


def _storage(signer: Signer | None) -> Signer:
    if signer is None:
        raise StorageUnavailable("this control plane has no checkpoint storage (TRAINYARD_S3_ENDPOINT)")
    return signer


def _checked(session: Session, job: Job, attempt: Attempt, req: Asked,
             settings: Settings) -> Callable[[Signer], StorageGrants]:
    """Check one request (raising a domain error: 403, 404, 409, 422) and record a PUT's key; what
    signs its URLs once the transaction is over."""
    if req.rank >= attempt.num_gpus:
        raise Forbidden(f"rank {req.rank} is outside attempt {attempt.number}'s world of {attempt.num_gpus}")
    prefix = keys.job_checkpoint_prefix(job.id)
    named = keys.parse_key(prefix, req.key)
    if named is None:
        # Another job's object, a listing, or a key the layout does not spell: nothing to sign.
        raise Forbidden(f"{req.key!r} is not a checkpoint object of job {job.id}")
    if req.method == "PUT":
        size = req.size_bytes or 0
        storage_bounds.check_put(session, job, attempt, named.step, size, settings)  # first: it bounds the step
        _check_put(session, job, attempt, req, named)
        storage_bounds.record(session, job, attempt, step=named.step, rank=req.rank, key=req.key, size_bytes=size,
                              upload_id=req.upload_id)
        return lambda signer: _put_grants(signer, req, settings)
    _check_readable(session, job, attempt, named)
    wanted = [req.key]
    if named.rank is None:  # a manifest: the shards a restore of this rank reads come with it
        wanted += [keys.shard_key(prefix, named.step, named.attempt_number, r) for r in sorted({req.rank, 0})]
    elif named.rank not in (req.rank, 0):
        raise Forbidden(f"rank {req.rank} restores its own shard and rank 0's, not rank {named.rank}'s")
    ttl = settings.storage_grant_ttl_s
    return lambda signer: StorageGrants(grants=[_signed(signer, GrantAction.get, "GET", key, ttl) for key in wanted])


def _check_put(session: Session, job: Job, attempt: Attempt, req: Asked, named: keys.CheckpointObject) -> None:
    if named.rank is None:
        raise Forbidden("workers do not write manifests: the control plane's commit does")
    if named.attempt_number != attempt.number or named.rank != req.rank:
        raise Forbidden(f"rank {req.rank} of attempt {attempt.number} writes only its own shards, "
                        f"not {req.key!r}")
    if attempt.outcome is not None and attempt.outcome != "failed":
        raise Conflict(f"attempt {attempt.number} already ended ({attempt.outcome}); no more shards")
    ckpt = session.execute(select(Checkpoint.id, Checkpoint.state).where(
        Checkpoint.job_id == job.id, Checkpoint.attempt_id == attempt.id, Checkpoint.step == named.step)).one_or_none()
    if ckpt is None:
        return
    if ckpt.state != "pending":
        raise Conflict(f"the checkpoint of step {named.step} is {ckpt.state}: its shards cannot be written again")
    reported = session.scalar(select(CheckpointShard.id).where(
        CheckpointShard.checkpoint_id == ckpt.id, CheckpointShard.rank == req.rank))
    if reported is not None:
        raise Conflict(f"rank {req.rank} already reported its shard of step {named.step}")


def _check_readable(session: Session, job: Job, attempt: Attempt, named: keys.CheckpointObject) -> None:
    """``named`` belongs to a checkpoint of the attempt's restore plan that is still in storage."""
    plan: dict[str, Any] = attempt.restore_manifest or {}
    ids = []
    for candidate in plan.get("candidates") or []:
        if candidate.get("step") == named.step and candidate.get("attempt_number") == named.attempt_number:
            try:
                ids.append(uuid.UUID(str(candidate.get("checkpoint_id"))))
            except ValueError:
                continue
    found = session.scalar(select(Checkpoint.id).where(
        Checkpoint.id.in_(ids), Checkpoint.job_id == job.id, Checkpoint.state.in_(READABLE))) if ids else None
    if found is None:
        raise NotFound(f"no readable checkpoint of attempt {attempt.number}'s restore plan has step {named.step} "
                       f"of attempt {named.attempt_number}")


def _put_grants(signer: Signer, req: Asked, settings: Settings) -> StorageGrants:
    size = req.size_bytes or 0
    part = settings.storage_part_size_mb * 2**20
    ttl = settings.storage_grant_ttl_s
    if size <= part:
        if req.upload_id is not None:
            raise Unprocessable(f"an object of {size} bytes is uploaded with one PUT, not in parts")
        return StorageGrants(grants=[_signed(signer, GrantAction.put, "PUT", req.key, ttl,
                                             headers={**CREATE_ONLY, **_length(size)})])
    parts = math.ceil(size / part)
    if parts > MAX_PARTS:
        raise Unprocessable(f"an object of {size} bytes needs {parts} parts of {part} bytes; S3 allows {MAX_PARTS}")
    if req.upload_id is None:
        create = _signed(signer, GrantAction.create_upload, "POST", req.key, ttl, query={"uploads": ""})
        return StorageGrants(grants=[create], part_size_bytes=part)
    upload = {"uploadId": req.upload_id}
    grants = [
        _signed(signer, GrantAction.upload_part, "PUT", req.key, ttl, query={**upload, "partNumber": str(n)},
                headers=_length(min(part, size - (n - 1) * part)), part_number=n)
        for n in range(1, parts + 1)
    ]
    grants.append(_signed(signer, GrantAction.complete_upload, "POST", req.key, ttl, query=upload,
                          headers=CREATE_ONLY))
    grants.append(_signed(signer, GrantAction.abort_upload, "DELETE", req.key, ttl, query=upload))
    return StorageGrants(grants=grants, part_size_bytes=part)


def _length(size: int) -> dict[str, str]:
    # Signed, so S3 refuses a body of any other size (a 403: the signature no longer matches): the
    # size the control plane bounded is the size that can be stored (storage_bounds.py).
    return {"Content-Length": str(size)}


def _signed(signer: Signer, action: GrantAction, method: str, key: str, ttl: int, *,
            headers: dict[str, str] | None = None, query: dict[str, str] | None = None,
            part_number: int | None = None) -> StorageGrant:
    # Signed at the shared clock's time, not this replica's wall clock, which may be off (S3 refuses
    # a URL dated in its future).
    at = now()
    url = signer.presign(method, key, expires_s=ttl, headers=headers, query=query, now=at)
    return StorageGrant(key=key, action=action, method=method, url=url, headers=dict(headers or {}),
                        part_number=part_number, expires_at=at + timedelta(seconds=ttl))
