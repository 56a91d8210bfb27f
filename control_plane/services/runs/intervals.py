"""The checkpoint interval the platform sets for ``checkpoint.interval_steps: "auto"`` (docs/goodput.md).

Young's rule (control_plane/goodput/rules.py ``choose_interval``) from the job's measured save cost
(what its recent saves blocked the loop, as the ranks reported with their shards; a configured prior
before the first), the job's MTBF (the cluster's failures per node-hour, with a configured prior
until it has history, times the job's node count) and its step time. The watchdog loop recomputes it
as measurements arrive; a change beyond 10% is stored on the job, recorded as a
``checkpoint.interval`` event with every input, and reaches the workers through the status report's
answer (their agent serves it on its local API; the ranks agree on it at their next save). A new
attempt starts with the interval current when it was allocated (in its launch spec).
"""

from __future__ import annotations

import statistics
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.goodput.rules import changed_enough, choose_interval, job_mtbf_s, node_failure_rate_per_h
from control_plane.models import Attempt, AttemptPart, Checkpoint, Job
from control_plane.services import events
from control_plane.services.locks import lock_job
from control_plane.settings import Settings
from trainyard.protocol.agent import CHECKPOINT_AUTO_FIRST_STEPS

AUTO = "auto"
HISTORY_DAYS = 30
"""The window of failures and node-hours the cluster's failure rate is taken from."""
COST_SAMPLES = 5
"""Recent saves whose blocking time makes the cost (their median)."""


def is_auto(job: Job) -> bool:
    return (job.checkpoint or {}).get("interval_steps") == AUTO


def launch_steps(job: Job) -> int | None:
    """The interval a new attempt of an 'auto' job starts with (None for other jobs): the one chosen
    last, else the job's first_interval_steps."""
    if not is_auto(job):
        return None
    chosen = (job.checkpoint_auto or {}).get("interval_steps")
    return int(chosen or job.checkpoint.get("first_interval_steps") or CHECKPOINT_AUTO_FIRST_STEPS)


def current_steps(session: Session, attempt: Attempt) -> int | None:
    """The interval an 'auto' job's workers should use now (the status report's answer)."""
    job = session.get(Job, attempt.job_id)
    if job is None or not is_auto(job):
        return None
    chosen = (job.checkpoint_auto or {}).get("interval_steps")
    return int(chosen) if chosen else attempt.checkpoint_interval_steps


def failure_history(session: Session) -> tuple[int, float]:
    """(node-attributed failures, node-hours of attempts) over the last HISTORY_DAYS days."""
    t = now()
    since = t - timedelta(days=HISTORY_DAYS)
    failures = session.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.outcome == "failed", Attempt.failed_node_id.is_not(None), Attempt.failed_at >= since)) or 0
    end = func.coalesce(AttemptPart.released_at, t)
    start = func.greatest(Attempt.created_at, since)
    hours = session.scalar(
        select(func.coalesce(func.sum(func.greatest(func.extract("epoch", end - start), 0)), 0) / 3600.0)
        .select_from(AttemptPart).join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .where(func.coalesce(AttemptPart.released_at, t) >= since)
    ) or 0.0
    return int(failures), float(hours)


def _costs(session: Session, job_id: uuid.UUID) -> tuple[float | None, float | None, int]:
    rows = session.execute(
        select(Checkpoint.blocking_s, Checkpoint.background_s)
        .where(Checkpoint.job_id == job_id, Checkpoint.blocking_s.is_not(None))
        .order_by(Checkpoint.created_at.desc()).limit(COST_SAMPLES)
    ).all()
    if not rows:
        return None, None, 0
    background = [r.background_s for r in rows if r.background_s is not None]
    return statistics.median(r.blocking_s for r in rows), (max(background) if background else None), len(rows)


def update(session: Session, settings: Settings) -> list[uuid.UUID]:
    """Recompute the interval of every running 'auto' job; returns the jobs whose interval changed."""
    # Each part measures its node's step time (services/runs/status_reports.py ``_advance``); the slowest sets the pace.
    step_time = func.max(AttemptPart.step_time_s)
    rows = session.execute(
        select(Attempt.job_id, step_time, Job.num_nodes, Job.checkpoint_auto)
        .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
        .join(Job, Job.id == Attempt.job_id)
        .where(Attempt.state == "running", Attempt.outcome.is_(None), AttemptPart.step_time_s.is_not(None),
               Job.checkpoint["interval_steps"].astext == AUTO)
        .group_by(Attempt.id, Job.id)
    ).all()
    if not rows:
        return []
    failures, node_hours = failure_history(session)
    rate = node_failure_rate_per_h(failures=failures, node_hours=node_hours,
                                   prior_mtbf_h=settings.failure_prior_node_mtbf_h,
                                   prior_weight_h=settings.failure_prior_weight_node_h)
    changed = []
    for job_id, step_time, nodes, auto in rows:
        cost, background, samples = _costs(session, job_id)
        measured = cost is not None
        cost = cost if cost is not None else settings.checkpoint_auto_cost_prior_s
        mtbf = job_mtbf_s(rate, nodes)
        choice = choose_interval(cost_s=cost, background_s=background, mtbf_s=mtbf, step_time_s=step_time,
                                 min_s=settings.checkpoint_auto_min_s)
        old = (auto or {}).get("interval_steps")
        if not changed_enough(old, choice.steps):
            continue
        job = lock_job(session, job_id)
        if job is None:
            continue
        inputs: dict[str, Any] = {
            "interval_steps": choice.steps, "interval_s": choice.seconds, "young_s": choice.young_s,
            "bound": choice.bound, "cost_s": round(cost, 4), "cost_measured": measured, "cost_samples": samples,
            "background_s": None if background is None else round(background, 4), "step_time_s": round(step_time, 4),
            "job_mtbf_s": round(mtbf, 1), "node_mtbf_h": round(1 / rate, 1), "nodes": nodes,
            "cluster_failures": failures, "cluster_node_hours": round(node_hours, 3), "previous_steps": old,
            "at": now().isoformat(),
        }
        job.checkpoint_auto = inputs
        events.record(session, "checkpoint.interval",
                      f"checkpoint interval {old or 'unset'} -> {choice.steps} steps ({choice.seconds:g}s): "
                      f"sqrt(2 x {cost:.3g}s save x {mtbf:.0f}s MTBF)" + (f", {choice.bound} bound" if choice.bound
                                                                         else ""),
                      job_id=job_id, **{k: v for k, v in inputs.items() if k != "at"})
        session.commit()
        changed.append(job_id)
    session.commit()
    return changed
