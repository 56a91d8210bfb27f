"""A job's progress as a person reads it: the step of how many, how fast, when it ends, the latest
metrics, and a sampled history for charts (the dashboard's loss and throughput)."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, Job, ProgressSample
from control_plane.services import pages
from trainyard.protocol.agent import Progress

SAMPLE_S = 5.0
"""At most one history sample per job this often: a chart's resolution, bounded rows per job-day."""
RATE_WEIGHT = 0.3
"""Weight of the newest interval in the smoothed step rate (an exponential moving average)."""


def merge(session: Session, job: Job, attempt: Attempt, progress: Progress, t: datetime) -> None:
    """Apply a report of the current attempt's progress (the caller checked it moves forward)."""
    first = attempt.progress_step is None
    if first:
        job.progress_rate = None  # a new attempt: its own rate, not the failed one's
    elif job.progress_at is not None and progress.step > attempt.progress_step:  # type: ignore[operator]
        elapsed = (progress.at - job.progress_at).total_seconds()
        if elapsed > 0:
            rate = (progress.step - attempt.progress_step) / elapsed  # type: ignore[operator]
            job.progress_rate = rate if job.progress_rate is None else (
                RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * job.progress_rate)
    attempt.progress_step = progress.step
    attempt.progress_metrics = stored_metrics(progress.metrics)
    job.progress_step = progress.step
    job.progress_loss = progress.loss
    job.progress_at = progress.at
    if progress.total_steps is not None:
        job.progress_total = progress.total_steps
    if first or job.progress_sampled_at is None or (t - job.progress_sampled_at).total_seconds() >= SAMPLE_S:
        job.progress_sampled_at = t
        session.add(ProgressSample(job_id=job.id, attempt_number=attempt.number, step=progress.step,
                                   loss=progress.loss, steps_per_s=job.progress_rate,
                                   metrics=stored_metrics(progress.metrics) or {}, at=progress.at))


def stored_metrics(metrics: Mapping[str, float]) -> dict[str, float] | None:
    """What is stored of a report's metrics: the wire contract bounds them (at most MAX_METRICS
    finite values under short names, trainyard/protocol/limits.py); JSONB holds no NaN or
    infinity, so a non-finite value that got past it is dropped rather than failing the report."""
    return {name: float(value) for name, value in sorted(metrics.items()) if math.isfinite(value)} or None


def eta_s(job: Job) -> float | None:
    if job.progress_total is None or job.progress_step is None or not job.progress_rate:
        return None
    return round(max(job.progress_total - job.progress_step, 0) / job.progress_rate, 1)


def chart_samples(session: Session, job_id: uuid.UUID, *, points: int = 600) -> list[ProgressSample]:
    """At most about ``points`` samples spread evenly over the job's whole history, the last one
    included: a chart of a week-long job reads a few hundred rows, not all of them."""
    numbered = select(ProgressSample.id, func.row_number().over(order_by=ProgressSample.id).label("n"),
                      func.count().over().label("total")).where(ProgressSample.job_id == job_id).subquery()
    every = func.greatest(numbered.c.total / points, 1)
    ids = select(numbered.c.id).where(or_((numbered.c.n - 1) % every == 0, numbered.c.n == numbered.c.total))
    return list(session.scalars(select(ProgressSample).where(ProgressSample.id.in_(ids))
                                .order_by(ProgressSample.id)))


def samples(session: Session, job_id: uuid.UUID, *, limit: int, cursor: str | None) -> tuple[list[ProgressSample],
                                                                                               str | None]:
    """The job's progress history, oldest first, ``limit`` at a time (keyset on the id)."""
    after = pages.decode(cursor, pages.int64)[0] if cursor else 0
    rows = list(session.scalars(select(ProgressSample).where(ProgressSample.job_id == job_id,
                                                            ProgressSample.id > after)
                                .order_by(ProgressSample.id).limit(limit + 1)))
    more = len(rows) > limit
    return rows[:limit], pages.encode(rows[limit - 1].id) if more else None
