"""The control plane's one lock order (docs/architecture.md, "Lock order").

Every transaction that locks rows of several kinds takes them in this order, and rows of one kind
in id order:

    nodes -> jobs -> attempts -> attempt parts (attempt_parts) -> checkpoints, leases

Rows are locked ``FOR NO KEY UPDATE`` to change them (a report that only reads the job and the
attempt for its fencing check shares them ``FOR SHARE`` instead, and never upgrades): no
transaction changes a primary key, and this mode does not conflict with the ``KEY SHARE`` lock a
foreign-key check takes when a row referring to it is inserted (an event, an attempt part, a
lease), so inserts never wait for, or deadlock with, a lock on the row they refer to. A
transaction that holds a job never locks (or updates) a node.

Every lock reloads the row (``populate_existing``): a row the session loaded before the lock was
granted may hold values another transaction has since changed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db import reload
from control_plane.models import Attempt, AttemptPart, Job, Node


def lock_node(session: Session, node_id: uuid.UUID) -> Node | None:
    """Lock one node (first in the order) and load it afresh."""
    return reload(session, select(Node).where(Node.id == node_id).with_for_update(key_share=True)).one_or_none()


def lock_job(session: Session, job_id: uuid.UUID) -> Job | None:
    return reload(session, select(Job).where(Job.id == job_id).with_for_update(key_share=True)).one_or_none()


def lock_jobs(session: Session, job_ids: Iterable[uuid.UUID]) -> list[Job]:
    """Lock jobs in id order."""
    ids = sorted(set(job_ids))
    if not ids:
        return []
    return list(reload(session, select(Job).where(Job.id.in_(ids)).order_by(Job.id).with_for_update(key_share=True)))


def lock_job_attempt(session: Session, attempt_id: uuid.UUID) -> tuple[Job, Attempt] | None:
    """Lock an attempt's job, then the attempt; both loaded afresh. None if the attempt is unknown."""
    job_id = session.scalar(select(Attempt.job_id).where(Attempt.id == attempt_id))
    if job_id is None:
        return None
    job = lock_job(session, job_id)
    attempt = reload(
        session, select(Attempt).where(Attempt.id == attempt_id).with_for_update(key_share=True)
    ).one_or_none()
    if job is None or attempt is None:
        return None
    return job, attempt


def share_job_attempt(session: Session, attempt_id: uuid.UUID) -> tuple[Job, Attempt] | None:
    """Lock an attempt's job, then the attempt, ``FOR SHARE`` (same order as lock_job_attempt);
    both loaded afresh. None if the attempt is unknown.

    For a report that only reads the two rows (the fencing check) and writes rows below them:
    sharers never wait for each other, and a change of either row (FOR NO KEY UPDATE) waits for
    them, so the attempt stays the job's current one until the report commits. A transaction that
    holds these share locks never locks either row exclusively afterwards: two sharers that both
    upgraded would deadlock."""
    job_id = session.scalar(select(Attempt.job_id).where(Attempt.id == attempt_id))
    if job_id is None:
        return None
    job = reload(session, select(Job).where(Job.id == job_id).with_for_update(read=True)).one_or_none()
    attempt = reload(
        session, select(Attempt).where(Attempt.id == attempt_id).with_for_update(read=True)
    ).one_or_none()
    if job is None or attempt is None:
        return None
    return job, attempt


def lock_attempts(session: Session, attempt_ids: Iterable[uuid.UUID]) -> list[Attempt]:
    """Lock attempts ``FOR NO KEY UPDATE`` without their jobs, in ``attempt_order``, and load them
    afresh (unknown ids are skipped). For a release (attempts.release_parts): the attempt lock
    serializes the releases of one gang, so the one that gives back the last part sees every
    release before it and ends the attempt in its own transaction. The caller holds no job it has
    not locked already in this order, no attempt part, and never locks a job after this."""
    ordered = attempt_order(session, attempt_ids)
    locked: list[Attempt] = []
    for attempt_id in ordered:  # one at a time: the order is the lock order, not the ids'
        attempt = reload(session, select(Attempt).where(Attempt.id == attempt_id)
                         .with_for_update(key_share=True)).one_or_none()
        if attempt is not None:
            locked.append(attempt)
    return locked


def lock_part(session: Session, part_id: uuid.UUID) -> AttemptPart:
    """Lock one attempt part (after its job and attempt, or after its node) and load it afresh."""
    return reload(session, select(AttemptPart).where(AttemptPart.id == part_id).with_for_update(key_share=True)).one()


def lock_parts(session: Session, part_ids: Iterable[uuid.UUID]) -> list[AttemptPart]:
    """Lock attempt parts in id order and load them afresh (missing ids are skipped)."""
    ids = sorted(set(part_ids))
    if not ids:
        return []
    return list(reload(session, select(AttemptPart).where(AttemptPart.id.in_(ids)).order_by(AttemptPart.id)
                       .with_for_update(key_share=True)))


def attempt_order(session: Session, attempt_ids: Iterable[uuid.UUID]) -> list[uuid.UUID]:
    """The attempts sorted as the lock order wants them: by job id, then attempt id."""
    ids = list(set(attempt_ids))
    if not ids:
        return []
    rows = session.execute(select(Attempt.id, Attempt.job_id).where(Attempt.id.in_(ids))).all()
    return [r.id for r in sorted(rows, key=lambda r: (r.job_id, r.id))]
