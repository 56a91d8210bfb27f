"""The storage sweep (issue 23, finding 7; docs/security.md, "Storage bounds"): objects a worker was
granted to create (storage_bounds.record) but that no checkpoint owns are deleted, and code
archives no job needs any more are deleted.

A granted key leaves the table once its step is decided or its attempt has ended:
- its checkpoint was committed (or later found unusable): the checkpoint owns the object, and
  checkpoint retention (services/checkpoints/checkpoints.py) deletes it with the checkpoint;
- its checkpoint was aborted or deleted: checkpoint retention deletes the whole step prefix; the
  sweep deletes the key too (idempotent), so the order of the two does not matter;
- no checkpoint and the attempt has ended: nobody ever reported it; the sweep deletes it.
A key of a pending checkpoint waits: maintenance commits or aborts it first. Network calls run
outside any transaction (STYLE 5); a key whose deletion fails stays for the next pass.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import structlog
from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import now
from control_plane.db import session_scope
from control_plane.models import Attempt, Checkpoint, CheckpointShard, Job, StoragePutGrant
from control_plane.services.states import JOB_TERMINAL

log = structlog.get_logger(__name__)

BATCH = 500
KEPT = ("committed", "unusable")
"""Checkpoint states whose reported shards stay in storage."""


def sweep_grants(factory: sessionmaker[Session], store: Any) -> int:
    """One pass over granted keys; returns how many objects were deleted."""
    with session_scope(factory) as s:
        ckpt = (select(Checkpoint.state).where(Checkpoint.attempt_id == StoragePutGrant.attempt_id,
                                               Checkpoint.step == StoragePutGrant.step)
                .limit(1).scalar_subquery())
        owned = (select(CheckpointShard.id).join(Checkpoint, Checkpoint.id == CheckpointShard.checkpoint_id)
                 .where(Checkpoint.attempt_id == StoragePutGrant.attempt_id, Checkpoint.step == StoragePutGrant.step,
                        Checkpoint.state.in_(KEPT), CheckpointShard.key == StoragePutGrant.key)
                 .exists())
        rows = s.execute(
            select(StoragePutGrant.id, StoragePutGrant.key, StoragePutGrant.upload_id, owned.label("owned"))
            .join(Attempt, Attempt.id == StoragePutGrant.attempt_id)
            .where(or_(
                and_(ckpt.is_not(None), ckpt != "pending"),
                and_(ckpt.is_(None), Attempt.state == "ended"),
            ))
            .order_by(StoragePutGrant.granted_at).limit(BATCH)
        ).all()
    done, deleted = [], 0
    for row in rows:
        try:
            if row.upload_id:
                store.abort_upload(row.key, row.upload_id)  # its parts are not objects: no listing shows them
            if not row.owned:
                store.delete(row.key)
                deleted += 1
        except Exception as exc:  # S3 down or slow: the row stays for the next pass
            log.warning("granted object not deleted yet", key=row.key, error=repr(exc))
            continue
        done.append(row.id)
    if done:
        with session_scope(factory) as s:
            s.execute(delete(StoragePutGrant).where(StoragePutGrant.id.in_(done)))
    return deleted


CODE_PREFIX = "code/"


def sweep_code(factory: sessionmaker[Session], store: Any, *, unreferenced_days: float) -> int:
    """Delete code archives that no unfinished job names and that no job has used (submitted or
    finished) within ``unreferenced_days`` of their upload; returns how many. 0 days: keep all."""
    if unreferenced_days <= 0 or store is None:
        return 0
    cutoff = now() - timedelta(days=unreferenced_days)
    old = [o for o in store.list_objects_modified(CODE_PREFIX) if o[1] is not None and o[1] < cutoff]
    if not old:
        return 0
    with session_scope(factory) as s:
        used: set[tuple[str, str]] = set()
        for tenant, code in s.execute(select(Job.tenant, Job.code).where(
                Job.code.is_not(None), or_(Job.state.not_in(JOB_TERMINAL), Job.updated_at >= cutoff))):
            used.add((tenant, str((code or {}).get("sha256"))))
    deleted = 0
    for key, _modified in old:
        tenant, _, name = key.removeprefix(CODE_PREFIX).partition("/")
        if (tenant, name.removesuffix(".tar.gz")) in used:
            continue
        try:
            store.delete(key)
            deleted += 1
        except Exception as exc:
            log.warning("code archive not deleted yet", key=key, error=repr(exc))
    return deleted
