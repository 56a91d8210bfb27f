"""Fencing: every report about an attempt must come from the job's current attempt, carry its
secret token, and come from the node that holds the claimed node rank (docs/architecture.md)."""

from __future__ import annotations

import secrets
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.errors import Forbidden, StaleAttempt
from control_plane.models import Attempt, AttemptNode, Job, Node
from control_plane.services.locks import lock_job_attempt, share_job_attempt


def lock_attempt(session: Session, attempt_id: uuid.UUID) -> tuple[Job, Attempt] | None:
    """Lock an attempt's job, then the attempt (FOR NO KEY UPDATE), and load both afresh; None if
    unknown.

    Every transaction takes its locks in one order, node -> job -> attempt -> attempt parts
    (services/locks.py), so two of them never deadlock, and a decision that reads the other parts
    (is every node released?) sees what the transactions before it committed.
    """
    return lock_job_attempt(session, attempt_id)


def authorize_report(
    session: Session, node: Node, attempt_id: uuid.UUID, fencing_token: str, node_rank: int,
    *, exclusive: bool = True,
) -> tuple[Job, Attempt, AttemptNode]:
    """Fencing: refuse anything not from the job's current attempt with the right token.

    ``exclusive`` locks the job and the attempt for a change of either (lock_attempt). A report
    that changes neither row (a shard report, most worker events) passes ``exclusive=False``: the
    two rows are then locked ``FOR SHARE`` (services/locks.py share_job_attempt), which holds off
    any change of the job's current attempt until the report commits, yet lets the reports of all
    the job's nodes proceed at once. Such a transaction must not then update or lock either row
    exclusively (two sharers upgrading would deadlock)."""
    locked = lock_attempt(session, attempt_id) if exclusive else share_job_attempt(session, attempt_id)
    if locked is None or not secrets.compare_digest(locked[1].fencing_token, fencing_token):
        raise StaleAttempt(f"attempt {attempt_id} is unknown or its fencing token does not match")
    job, attempt = locked
    if job.current_attempt_id != attempt.id:
        raise StaleAttempt(
            f"attempt {attempt.number} of job {job.id} is stale: the current attempt is another one",
            attempt_id=str(attempt_id),
        )
    part = session.scalar(
        select(AttemptNode).where(AttemptNode.attempt_id == attempt.id, AttemptNode.node_rank == node_rank)
    )
    if part is None or part.node_id != node.id:
        raise Forbidden(f"node {node.name} does not hold node rank {node_rank} of attempt {attempt_id}")
    return job, attempt, part
