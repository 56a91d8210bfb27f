"""Fencing: every report about an attempt must come from the job's current attempt, carry its
secret token, and come from the node that holds the claimed node rank (docs/architecture.md)."""

from __future__ import annotations

import secrets
import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.errors import Forbidden, StaleAttempt
from control_plane.models import Attempt, AttemptNode, Job, Node


def authorize_report(
    session: Session, node: Node, attempt_id: uuid.UUID, fencing_token: str, node_rank: int
) -> tuple[Job, Attempt, AttemptNode]:
    """Fencing: refuse anything not from the job's current attempt with the right token."""
    attempt = session.get(Attempt, attempt_id, with_for_update=True)
    if attempt is None or not secrets.compare_digest(attempt.fencing_token, fencing_token):
        raise StaleAttempt(f"attempt {attempt_id} is unknown or its fencing token does not match")
    job = session.get(Job, attempt.job_id, with_for_update=True)
    assert job is not None
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
