"""Training progress of attempts and jobs, derived from their parts.

A status report writes progress to its own node's part only (never to the job or the attempt
row: docs/architecture.md, "Lock order"), so the nodes of one job report without waiting for each
other. An attempt's progress is its parts' furthest step; a job's is that of its latest attempt
that reported any (after a recovery it starts again from the restored step, and until the new
attempt's first report the job keeps showing where the failed one got to).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptNode


@dataclass(frozen=True)
class Progress:
    step: int | None = None
    loss: float | None = None
    at: datetime | None = None
    """When the workers reported ``step`` (the node's clock)."""
    metrics: dict[str, float] | None = None
    """The metrics of that report (the measured compute/communication split, ...)."""
    first_at: datetime | None = None
    """When the attempt's first step arrived (any node; the control plane's clock)."""


NONE = Progress()


def of_parts(parts: Iterable[AttemptNode]) -> Progress:
    """An attempt's progress from its (loaded) parts."""
    reported = [p for p in parts if p.progress_step is not None]
    if not reported:
        return NONE
    best = max(reported, key=lambda p: (p.progress_step or 0, p.progress_at is not None, p.progress_at))
    firsts = [p.first_progress_at for p in reported if p.first_progress_at is not None]
    return Progress(step=best.progress_step, loss=best.progress_loss, at=best.progress_at,
                    metrics=best.progress_metrics, first_at=min(firsts) if firsts else None)


def first_at(session: Session, attempt_id: uuid.UUID) -> datetime | None:
    """When the attempt's first step arrived."""
    value: datetime | None = session.scalar(
        select(func.min(AttemptNode.first_progress_at)).where(AttemptNode.attempt_id == attempt_id))
    return value


def step_of(session: Session, attempt_id: uuid.UUID) -> int | None:
    """The furthest step the attempt reported."""
    value: int | None = session.scalar(
        select(func.max(AttemptNode.progress_step)).where(AttemptNode.attempt_id == attempt_id))
    return value


def of_jobs(session: Session, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Progress]:
    """Each job's progress: its latest attempt's that reported any step. One query for all."""
    ids = list(set(job_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(Attempt.job_id, AttemptNode.progress_step, AttemptNode.progress_loss, AttemptNode.progress_at,
               AttemptNode.progress_metrics)
        .join(Attempt, Attempt.id == AttemptNode.attempt_id)
        .where(Attempt.job_id.in_(ids), AttemptNode.progress_step.is_not(None))
        .order_by(Attempt.job_id, Attempt.number.desc(), AttemptNode.progress_step.desc(),
                  AttemptNode.progress_at.desc().nulls_last())
        .ext(distinct_on(Attempt.job_id))
    ).all()
    return {r.job_id: Progress(step=r.progress_step, loss=r.progress_loss, at=r.progress_at, metrics=r.progress_metrics)
            for r in rows}
