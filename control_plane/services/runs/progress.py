"""Training progress of attempts and jobs, derived from their parts, as a person reads it: the step
of how many, how fast, when it ends, the latest metrics, and a sampled history for charts (the
dashboard's loss and throughput).

A status report writes progress to its own node's part only (never to the job or the attempt
row: docs/architecture.md, "Lock order"), so the nodes of one job report without waiting for each
other. An attempt's progress is its parts' furthest step; a job's is that of its latest attempt
that reported any (after a recovery it starts again from the restored step, and until the new
attempt's first report the job keeps showing where the failed one got to). The step rate is
smoothed per part too (only global rank 0 reports unless a script says otherwise, so it is that
node's), and history samples are inserted rows, so they take no lock of the job either.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.dialects.postgresql import distinct_on
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptPart, ProgressSample
from control_plane.services import pages
from trainyard.protocol.agent import Progress as Report

SAMPLE_S = 5.0
"""At most one history sample per part this often once a job has run a while: a chart's
resolution, bounded rows per job-day."""
SAMPLE_MIN_S = 1.0
SAMPLE_RAMP_S = 60.0
"""A young part samples more often, every max(SAMPLE_MIN_S, age / SAMPLE_RAMP_S) up to SAMPLE_S: a
one-minute job's chart has about 60 points, not 13 (about 160 extra rows in a job's first 5 minutes)."""


def sample_interval_s(age_s: float) -> float:
    """How long after its last history sample a part of this age takes the next one."""
    return min(SAMPLE_S, max(SAMPLE_MIN_S, age_s / SAMPLE_RAMP_S))
RATE_WEIGHT = 0.3
"""Weight of the newest interval in the smoothed step rate (an exponential moving average)."""


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
    total: int | None = None
    """Total steps, when the script says."""
    rate: float | None = None
    """Steps per second, smoothed over the recent reports."""

    def eta_s(self) -> float | None:
        if self.total is None or self.step is None or not self.rate:
            return None
        return round(max(self.total - self.step, 0) / self.rate, 1)


NONE = Progress()


def merge(session: Session, job_id: uuid.UUID, attempt_number: int, part: AttemptPart, report: Report,
          t: datetime) -> None:
    """Apply a report of a part's progress (the caller checked it does not go back): the part's
    row and, at most every SAMPLE_S, a history sample (an insert)."""
    first = part.progress_step is None
    if first:
        part.first_progress_at = t
    elif part.progress_at is not None and report.step > part.progress_step:  # type: ignore[operator]
        elapsed = (report.at - part.progress_at).total_seconds()
        if elapsed > 0:
            rate = (report.step - part.progress_step) / elapsed  # type: ignore[operator]
            part.progress_rate = rate if part.progress_rate is None else (
                RATE_WEIGHT * rate + (1 - RATE_WEIGHT) * part.progress_rate)
    part.progress_step = report.step
    part.progress_loss = report.loss
    part.progress_at = report.at
    part.progress_metrics = stored_metrics(report.metrics)
    if report.total_steps is not None:
        part.progress_total = report.total_steps
    started = part.first_progress_at
    age_s = (t - started).total_seconds() if started is not None else SAMPLE_RAMP_S * SAMPLE_S
    if first or part.progress_sampled_at is None or \
            (t - part.progress_sampled_at).total_seconds() >= sample_interval_s(age_s):
        part.progress_sampled_at = t
        session.add(ProgressSample(job_id=job_id, attempt_number=attempt_number, step=report.step,
                                   loss=report.loss, steps_per_s=part.progress_rate,
                                   metrics=part.progress_metrics or {}, at=report.at))


def stored_metrics(metrics: Mapping[str, float]) -> dict[str, float] | None:
    """What is stored of a report's metrics: the wire contract bounds them (at most MAX_METRICS
    finite values under short names, trainyard/protocol/limits.py); JSONB holds no NaN or
    infinity, so a non-finite value that got past it is dropped rather than failing the report."""
    return {name: float(value) for name, value in sorted(metrics.items()) if math.isfinite(value)} or None


def of_parts(parts: Iterable[AttemptPart]) -> Progress:
    """An attempt's progress from its (loaded) parts."""
    reported = [p for p in parts if p.progress_step is not None]
    if not reported:
        return NONE
    best = max(reported, key=lambda p: (p.progress_step or 0, p.progress_at is not None, p.progress_at))
    firsts = [p.first_progress_at for p in reported if p.first_progress_at is not None]
    return Progress(step=best.progress_step, loss=best.progress_loss, at=best.progress_at,
                    metrics=best.progress_metrics, first_at=min(firsts) if firsts else None,
                    total=best.progress_total, rate=best.progress_rate)


def first_at(session: Session, attempt_id: uuid.UUID) -> datetime | None:
    """When the attempt's first step arrived."""
    value: datetime | None = session.scalar(
        select(func.min(AttemptPart.first_progress_at)).where(AttemptPart.attempt_id == attempt_id))
    return value


def step_of(session: Session, attempt_id: uuid.UUID) -> int | None:
    """The furthest step the attempt reported."""
    value: int | None = session.scalar(
        select(func.max(AttemptPart.progress_step)).where(AttemptPart.attempt_id == attempt_id))
    return value


def of_jobs(session: Session, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, Progress]:
    """Each job's progress: its latest attempt's that reported any step. One query for all."""
    ids = list(set(job_ids))
    if not ids:
        return {}
    rows = session.execute(
        select(Attempt.job_id, AttemptPart.progress_step, AttemptPart.progress_loss, AttemptPart.progress_at,
               AttemptPart.progress_metrics, AttemptPart.progress_total, AttemptPart.progress_rate)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .where(Attempt.job_id.in_(ids), AttemptPart.progress_step.is_not(None))
        .order_by(Attempt.job_id, Attempt.number.desc(), AttemptPart.progress_step.desc(),
                  AttemptPart.progress_at.desc().nulls_last())
        .ext(distinct_on(Attempt.job_id))
    ).all()
    return {r.job_id: Progress(step=r.progress_step, loss=r.progress_loss, at=r.progress_at, metrics=r.progress_metrics,
                               total=r.progress_total, rate=r.progress_rate)
            for r in rows}


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
