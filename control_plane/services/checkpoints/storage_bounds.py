"""What a worker may be granted to write, bounded (issue 23, finding 7; docs/security.md, "Storage
bounds"): a shard no larger than a shard of this job can be, only for the attempt's current save,
and every granted key recorded so that one never reported is deleted (services/checkpoints/storage_sweep.py).

Without these a worker of any job could ask for a 5 TiB object at every step number it liked and
fill the bucket that every tenant's checkpoints share. The size is signed into the URL
(storage_grants.py signs Content-Length), so S3 itself refuses a larger body.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import Conflict, Forbidden, Unprocessable
from control_plane.models import Attempt, AttemptPart, Checkpoint, CheckpointShard, Job, StoragePutGrant
from control_plane.settings import Settings

MAX_STEP = 2**31 - 1
"""Steps are stored as 32-bit integers (checkpoints.step)."""
GIB = 2**30
MIB = 2**20


class ShardTooLarge(Unprocessable):
    """The shard is larger than a shard of this job may be."""

    slug = "shard-too-large"


class StepOutOfReach(Forbidden):
    """The step is not one this attempt can be saving now."""

    slug = "step-out-of-reach"


class TooManyOpenSaves(Conflict):
    """The attempt already has as many saves in flight as it may."""

    slug = "too-many-open-saves"


def shard_limit(largest_committed: int | None, settings: Settings) -> int:
    """The most bytes one shard may be granted (pure): the operator's cap, lowered once the job has
    committed a checkpoint to a multiple of its largest shard (a model's state does not grow tenfold
    between saves; the multiple leaves room for optimizer state that appears after the first step)."""
    cap = int(settings.storage_max_shard_gb * GIB)
    if largest_committed and settings.storage_shard_growth > 0:
        observed = max(int(settings.storage_shard_growth * largest_committed), settings.storage_shard_floor_mb * MIB)
        cap = min(cap, observed)
    return cap


def check_put(session: Session, job: Job, attempt: Attempt, step: int, size_bytes: int, settings: Settings) -> None:
    """Raise a domain error unless a shard of ``size_bytes`` at ``step`` is within the bounds."""
    largest = session.scalar(
        select(func.max(CheckpointShard.size_bytes)).join(Checkpoint, Checkpoint.id == CheckpointShard.checkpoint_id)
        .where(Checkpoint.job_id == job.id, Checkpoint.state == "committed"))
    limit = shard_limit(largest, settings)
    if size_bytes > limit:
        why = (f"{settings.storage_shard_growth:g} x the job's largest committed shard ({largest} bytes)"
               if limit < int(settings.storage_max_shard_gb * GIB) else
               f"storage_max_shard_gb={settings.storage_max_shard_gb:g}")
        raise ShardTooLarge(f"a shard of {size_bytes} bytes is larger than this job's shards may be: at most {limit} "
                            f"bytes ({why})", field="size_bytes", limit_bytes=limit)
    known = max(
        session.scalar(select(func.max(AttemptPart.progress_step)).where(AttemptPart.attempt_id == attempt.id)) or 0,
        attempt.restored_from_step or 0,
        session.scalar(select(func.max(Checkpoint.step)).where(
            Checkpoint.job_id == job.id, Checkpoint.state == "committed")) or 0,
    )
    if step > min(known + settings.storage_step_lead, MAX_STEP):
        raise StepOutOfReach(f"step {step} is beyond attempt {attempt.number}'s current save: its last known step is "
                             f"{known}, and a save may be at most {settings.storage_step_lead} steps ahead "
                             "(storage_step_lead)")
    fresh = now() - timedelta(seconds=settings.checkpoint_pending_timeout_s)
    decided = select(Checkpoint.step).where(Checkpoint.attempt_id == attempt.id, Checkpoint.state != "pending")
    open_steps = sorted(session.scalars(
        select(StoragePutGrant.step).where(
            StoragePutGrant.attempt_id == attempt.id, StoragePutGrant.step != step,
            StoragePutGrant.granted_at > fresh, StoragePutGrant.step.not_in(decided))
        .distinct()))
    if len(open_steps) >= settings.storage_open_saves:
        raise TooManyOpenSaves(f"attempt {attempt.number} already has saves of steps {open_steps} in flight; at most "
                               f"{settings.storage_open_saves} at once (storage_open_saves): finish or abort one first")


def record(session: Session, job: Job, attempt: Attempt, *, step: int, rank: int, key: str, size_bytes: int,
           upload_id: str | None) -> None:
    """Remember the granted key (the sweep deletes it if it is never reported). One upload in parts
    per key: parts for another upload id are refused, so the parts of many abandoned uploads (which
    S3 keeps, invisible to listings) cannot pile up under one key."""
    row = session.execute(select(StoragePutGrant.upload_id, StoragePutGrant.size_bytes)
                          .where(StoragePutGrant.key == key).with_for_update()).one_or_none()
    if row is not None and upload_id is not None and row.upload_id not in (None, upload_id):
        raise Conflict(f"{key!r} is already being uploaded in parts (another upload id): one upload per shard")
    values = {"job_id": job.id, "attempt_id": attempt.id, "step": step, "rank": rank, "key": key,
              "size_bytes": max(size_bytes, row.size_bytes if row is not None else 0),
              "upload_id": upload_id if upload_id is not None else (row.upload_id if row is not None else None),
              "granted_at": now()}
    stmt = pg_insert(StoragePutGrant).values(**values)
    session.execute(stmt.on_conflict_do_update(index_elements=["key"], set_={
        k: stmt.excluded[k] for k in ("size_bytes", "upload_id", "granted_at")}))
