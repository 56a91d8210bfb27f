"""Goodput of jobs and of the cluster, from the rows the platform already keeps (attempts, leases,
workers' exits, checkpoints' reported stalls): services read them, control_plane/goodput/accounting.py
splits the time. docs/goodput.md says what each component is."""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

from sqlalchemy import func, literal, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.goodput.accounting import AttemptFacts, Breakdown, JobFacts, account
from control_plane.models import Attempt, AttemptPart, Checkpoint, GpuLease, Job, Worker
from control_plane.schemas.goodput import ClusterGoodputOut, GoodputOut
from control_plane.schemas.scheduling import SchedulingOut
from control_plane.services.cluster import reservations


def _facts(session: Session, jobs: list[Job]) -> dict[uuid.UUID, JobFacts]:
    if not jobs:
        return {}
    t = now()
    ids = [j.id for j in jobs]
    # Progress lives on the parts (services/runs/progress.py): an attempt's is its parts' furthest.
    parts = (select(AttemptPart.attempt_id, func.min(AttemptPart.first_progress_at).label("first_progress_at"),
                    func.max(AttemptPart.step_advanced_at).label("step_advanced_at"),
                    func.max(AttemptPart.progress_at).label("progress_at"),
                    func.max(AttemptPart.progress_step).label("progress_step"))
             .join(Attempt, Attempt.id == AttemptPart.attempt_id)
             .where(Attempt.job_id.in_(ids)).group_by(AttemptPart.attempt_id).subquery())
    attempts = session.execute(
        select(Attempt.id, Attempt.job_id, Attempt.number, Attempt.num_gpus, Attempt.created_at,
               Attempt.restored_from_step, parts.c.first_progress_at, parts.c.step_advanced_at,
               parts.c.progress_step, parts.c.progress_at, Attempt.outcome, Attempt.failed_at, Attempt.hung_since)
        .outerjoin(parts, parts.c.attempt_id == Attempt.id)
        .where(Attempt.job_id.in_(ids))
    ).all()
    attempt_ids = [a.id for a in attempts]
    held = func.sum(func.extract("epoch", func.coalesce(GpuLease.released_at, literal(t)) - GpuLease.created_at))
    leases = {row.attempt_id: row for row in session.execute(
        select(GpuLease.attempt_id, held.label("gpu_s"), func.max(GpuLease.released_at).label("released"),
               func.count().filter(GpuLease.released_at.is_(None)).label("holding"))
        .where(GpuLease.job_id.in_(ids)).group_by(GpuLease.attempt_id)
    )}
    stalls: dict[uuid.UUID, float] = dict(session.execute(  # type: ignore[arg-type]
        select(Checkpoint.attempt_id, func.sum(Checkpoint.blocking_s))
        .where(Checkpoint.job_id.in_(ids), Checkpoint.blocking_s.is_not(None)).group_by(Checkpoint.attempt_id)
    ).all()) if attempt_ids else {}
    exits: dict[uuid.UUID, Any] = dict(session.execute(  # type: ignore[arg-type]
        select(Worker.attempt_id, func.min(Worker.ended_at))
        .where(Worker.attempt_id.in_([a.id for a in attempts if a.outcome == "failed"]),
               Worker.exit_code.is_not(None), Worker.exit_code != 0)
        .group_by(Worker.attempt_id)
    ).all()) if any(a.outcome == "failed" for a in attempts) else {}
    by_job: dict[uuid.UUID, list[AttemptFacts]] = defaultdict(list)
    for a in attempts:
        lease = leases.get(a.id)
        failed = a.outcome == "failed"
        failure_at = a.failed_at
        last_step_at = a.step_advanced_at or a.first_progress_at
        if failed and exits.get(a.id) is not None and a.hung_since is None:
            failure_at = min(failure_at or exits[a.id], exits[a.id])  # the first exit, as the recovery view
            # An exit is timed by its node's clock, and so is the last step the workers reported: the
            # step in progress is lost work from one to the other. The time that step's report
            # arrived could come after the exit (reports are relayed every interval) and would hide it.
            last_step_at = a.progress_at or last_step_at
        by_job[a.job_id].append(AttemptFacts(
            number=a.number, gpus=a.num_gpus, allocated_at=a.created_at,
            leases_gpu_s=float(lease.gpu_s or 0.0) if lease else 0.0,
            released_at=lease.released if lease is not None and not lease.holding else None,
            start_step=a.restored_from_step or 0, first_step_at=a.first_progress_at,
            last_step_at=last_step_at, last_step=a.progress_step,
            failed=failed, failure_at=failure_at, hung_since=a.hung_since,
            stall_s=float(stalls.get(a.id) or 0.0),
        ))
    return {j.id: JobFacts(created_at=j.created_at, gpus=j.num_gpus, attempts=by_job.get(j.id, []), now=t)
            for j in jobs}


def _out(b: Breakdown) -> dict[str, Any]:
    return {
        "goodput": b.goodput,
        **{name: round(getattr(b, name), 3) for name in (
            "allocated_gpu_s", "productive_gpu_s", "checkpoint_stall_gpu_s", "lost_work_gpu_s", "recovery_gpu_s",
            "hung_gpu_s", "startup_gpu_s", "other_gpu_s", "queueing_gpu_s", "recovery_downtime_s", "hung_s",
            "queued_s")},
        "steps_productive": b.steps_productive, "steps_lost": b.steps_lost, "recoveries": b.recoveries,
    }


def breakdowns(session: Session, jobs: list[Job]) -> dict[uuid.UUID, Breakdown]:
    return {job_id: account(facts) for job_id, facts in _facts(session, jobs).items()}


def for_jobs(session: Session, jobs: list[Job]) -> dict[uuid.UUID, GoodputOut]:
    """The job view's goodput of each job (a few grouped queries for the whole page)."""
    return {job_id: GoodputOut(**_out(b)) for job_id, b in breakdowns(session, jobs).items()}


def cluster_breakdown(session: Session, *, tenant: str | None = None, batch: int = 2000) -> tuple[Breakdown, int]:
    """Every job's breakdown summed (a tenant's jobs only, with ``tenant``); jobs are read in batches."""
    total, count, last = Breakdown(), 0, None
    while True:
        stmt = select(Job).order_by(Job.id).limit(batch)
        if tenant is not None:
            stmt = stmt.where(Job.tenant == tenant)
        if last is not None:
            stmt = stmt.where(Job.id > last)
        jobs = list(session.scalars(stmt))
        if not jobs:
            return total, count
        for b in breakdowns(session, jobs).values():
            total.add(b)
        count += len(jobs)
        last = jobs[-1].id
        session.expunge_all()


def for_cluster(session: Session, held: SchedulingOut | None = None, *, tenant: str | None = None) -> ClusterGoodputOut:
    """The cluster's goodput; ``held``: the scheduler's holds when the caller read them already. A
    tenant's view sums its own jobs (the idle GPU-time the scheduler held is the cluster's)."""
    total, jobs = cluster_breakdown(session, tenant=tenant)
    held = held or reservations.summary(session)
    reserve = sum(r.idle_gpu_seconds for r in held.recovery_reserve)
    return ClusterGoodputOut(**_out(total), jobs=jobs,
                             reservation_idle_gpu_s=round(held.reservation_idle_gpu_seconds, 3),
                             recovery_reserve_idle_gpu_s=round(reserve, 3), computed_at=now())
