"""Read models: turn rows into the API's response schemas (no state changes here)."""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog
from pydantic import ValidationError
from sqlalchemy import and_, func, select, tuple_
from sqlalchemy.orm import Session, selectinload

from control_plane.clock import now
from control_plane.models import (
    Attempt,
    AttemptPart,
    Checkpoint,
    CheckpointShard,
    Event,
    Gpu,
    GpuLease,
    Job,
    Node,
    Worker,
)
from control_plane.schemas.goodput import StragglerOut
from control_plane.schemas.jobs import (
    AllocationEntry,
    AttemptOut,
    AttemptPage,
    AttemptPartOut,
    AttemptRef,
    CheckpointOut,
    CheckpointPage,
    CodeOut,
    EventOut,
    EventPage,
    JobOut,
    JobProgress,
    ProgressPage,
    ProgressSampleOut,
    RecoveryOut,
    RecoveryOverrunOut,
    SplitOut,
    StepSplitOut,
    WorkerOut,
)
from control_plane.schemas.nodes import GpuOut, NodeOut
from control_plane.schemas.plans import JobPlanOut
from control_plane.schemas.scheduling import ReservationOut
from control_plane.schemas.uploads import CheckpointUploadOut
from control_plane.services import events, pages
from control_plane.services.checkpoints.memtier import memory_tier_on
from control_plane.services.cluster import reservations, tenants
from control_plane.services.cluster.nodes import scheduling_state
from control_plane.services.read import goodput
from control_plane.services.runs import progress, recovery_budget, watchdog
from control_plane.services.states import JOB_ACTIVE, JOB_TERMINAL, JOB_WAITING, NODE_UNREACHABLE, PART_UNLAUNCHED
from trainyard.protocol.layout import METRIC_COMM_S, METRIC_COMPUTE_S, METRIC_STEP_S, Layout

log = structlog.get_logger("trainyard.views")


def _s(value: uuid.UUID | None) -> str | None:
    return str(value) if value is not None else None


def job_out(session: Session, job: Job) -> JobOut:
    return jobs_out(session, [job])[0]


def jobs_out(session: Session, jobs: list[Job]) -> list[JobOut]:
    attempt_ids = [j.current_attempt_id for j in jobs if j.current_attempt_id]
    attempts = {
        a.id: a
        for a in session.scalars(
            select(Attempt)
            .where(Attempt.id.in_(attempt_ids))
            .options(selectinload(Attempt.nodes).selectinload(AttemptPart.node))
        )
    } if attempt_ids else {}
    held = reservations.active_for_jobs(session, [j.id for j in jobs if j.state in JOB_WAITING])
    leases = dict(session.execute(
        select(GpuLease.job_id, func.count()).where(GpuLease.job_id.in_([j.id for j in jobs]),
                                                    GpuLease.released_at.is_(None))
        .group_by(GpuLease.job_id)
    ).all()) if jobs else {}
    waiting = _waiting_for(session, jobs, attempts, held)
    done = progress.of_jobs(session, [j.id for j in jobs])
    figures = goodput.for_jobs(session, jobs)
    slow = _stragglers(session, [a for a in attempts.values() if a.state != "ended"])
    out = []
    for job in jobs:
        attempt = attempts.get(job.current_attempt_id) if job.current_attempt_id else None
        allocation = []
        if attempt is not None and attempt.state != "ended":
            allocation = [
                AllocationEntry(node_id=str(p.node_id), node_name=p.node.name, node_rank=p.node_rank,
                                gpu_indices=list(p.gpu_indices))
                for p in attempt.nodes
                if p.released_at is None
            ]
        plan = _stored_plan(job)
        metrics = (progress.of_parts(attempt.nodes).metrics if attempt is not None else None) or {}
        now_at = done.get(job.id, progress.NONE)
        out.append(
            JobOut(
                id=str(job.id),
                name=job.name,
                tenant=job.tenant,
                priority=job.priority,
                state=job.state,
                num_nodes=job.num_nodes,
                gpus_per_node=job.gpus_per_node,
                entrypoint=job.entrypoint,
                args=list(job.args),
                command=list(job.command) if job.command else None,
                env=dict(job.env),
                checkpoint={**job.checkpoint, "memory_tier": memory_tier_on(job)},
                max_failures=job.max_failures,
                failures=job.failures,
                time_limit_s=job.time_limit_s,
                gpu_kind=_kinds_out(job.gpu_kinds),
                allocated_gpu_kind=attempt.gpu_kind if attempt is not None else None,
                model=job.model,
                layout=Layout.model_validate(job.layout) if job.layout else None,
                plan=plan,
                code=CodeOut.model_validate(job.code) if job.code else None,
                python=job.python,
                requirements=job.requirements,
                restartable=job.restartable,
                retry_same_exception=job.retry_same_exception,
                progress=JobProgress(step=now_at.step, loss=now_at.loss, updated_at=now_at.at,
                                     total_steps=now_at.total, metrics=metrics,
                                     steps_per_s=round(now_at.rate, 4) if now_at.rate else None,
                                     eta_s=now_at.eta_s() if job.state in JOB_ACTIVE else None),
                split=step_split(plan, metrics),
                result=job.result,
                end_reason=job.end_reason,
                current_attempt=AttemptRef(id=str(attempt.id), number=attempt.number, state=attempt.state,
                                           outcome=attempt.outcome) if attempt else None,
                allocation=allocation,
                reservation=held.get(job.id),
                waiting_for=waiting.get(job.id),
                leases_held=leases.get(job.id, 0),
                releasing=job.state in JOB_TERMINAL and leases.get(job.id, 0) > 0,
                watchdog=job.watchdog,
                checkpoint_interval=job.checkpoint_auto,
                stragglers=slow.get(attempt.id, []) if attempt is not None else [],
                goodput=figures.get(job.id),
                created_at=job.created_at,
                started_at=job.started_at,
                ended_at=job.ended_at,
            )
        )
    return out


def _stragglers(session: Session, attempts: list[Attempt]) -> dict[uuid.UUID, list[StragglerOut]]:
    """The ranks named stragglers in each attempt (still slow), against the median of all its ranks."""
    named = [p for a in attempts for p in a.nodes if p.straggler_named_at is not None and p.ranks]
    out: dict[uuid.UUID, list[StragglerOut]] = {}
    for attempt in {p.attempt_id: a for a in attempts for p in a.nodes if p in named}.values():
        values = [t.busy_s if t.busy_s is not None else t.step_time_s for t in watchdog.timings(attempt.nodes)]
        known = [v for v in values if v]
        peers = statistics.median(known) if known else 0.0
        for p in attempt.nodes:
            if p not in named:
                continue
            mine = next((r for r in p.ranks["ranks"] if r["rank"] == p.straggler_rank), None)  # type: ignore[index]
            busy = (mine or {}).get("busy_s") or (mine or {}).get("step_time_s") or 0.0
            out.setdefault(attempt.id, []).append(StragglerOut(
                rank=p.straggler_rank or 0, node=p.node.name, node_id=str(p.node_id), busy_s=round(busy, 4),
                peers_busy_s=round(peers, 4), ratio=round(busy / peers, 3) if peers else 0.0,
                since=p.straggler_since or p.straggler_named_at))
    return out


def step_split(plan: JobPlanOut | None, metrics: dict[str, float]) -> SplitOut:
    """The plan's row for the job's count beside the measured metrics (METRIC_* names)."""
    row = plan.row if plan is not None else None
    predicted = measured = None
    if row is not None and row.step_s and row.compute_s is not None and row.exposed_comm_s is not None:
        predicted = StepSplitOut(step_s=row.step_s, compute_s=row.compute_s, comm_s=row.exposed_comm_s,
                                 comm_share=row.exposed_comm_s / row.step_s)
    step, comm = metrics.get(METRIC_STEP_S), metrics.get(METRIC_COMM_S)
    if step and step > 0 and comm is not None:
        measured = StepSplitOut(step_s=step, compute_s=metrics.get(METRIC_COMPUTE_S, step - comm), comm_s=comm,
                                comm_share=comm / step)
    ratio = measured.step_s / predicted.step_s if measured and predicted else None
    return SplitOut(predicted=predicted, measured=measured, step_ratio=ratio)


def _stored_plan(job: Job) -> JobPlanOut | None:
    """The plan stored at submit. One stored by another version that no longer reads is left out
    (the job runs regardless), never a 500."""
    if not job.plan:
        return None
    try:
        return JobPlanOut.model_validate(job.plan)
    except ValidationError:
        log.warning("stored plan does not read; left out of the job view", job_id=str(job.id))
        return None


@dataclass(frozen=True)
class _NodeCap:
    name: str
    state: str
    schedulable: bool
    draining: bool
    kind: str
    total: int
    free: int


def _node_caps(session: Session) -> list[_NodeCap]:
    rows = session.execute(
        select(Node.name, Node.state, Node.schedulable, Node.draining, func.min(Gpu.kind), func.count(Gpu.id),
               func.count(Gpu.id).filter(GpuLease.id.is_(None)))
        .join(Gpu, Gpu.node_id == Node.id)
        .outerjoin(GpuLease, and_(GpuLease.gpu_id == Gpu.id, GpuLease.released_at.is_(None)))
        .where(Node.state != "removed")
        .group_by(Node.id)
        .order_by(Node.name)
    ).all()
    return [_NodeCap(*row) for row in rows]


def _why_not(n: _NodeCap) -> str:
    if n.state != "ready":
        return f"{n.name} {n.state}"
    return f"{n.name} {'draining' if n.draining else 'cordoned'}"


def _waiting_for(session: Session, jobs: list[Job], attempts: dict[uuid.UUID, Attempt],
                 held: dict[uuid.UUID, ReservationOut]) -> dict[uuid.UUID, str]:
    """What each job that is not running or ended waits for, in words (the job view's waiting_for)."""
    out: dict[uuid.UUID, str] = {}
    queued = [j for j in jobs if j.state in JOB_WAITING]
    caps = _node_caps(session) if queued else []
    quotas = tenants.all_tenants(session) if queued else {}
    usage = tenants.gpus_in_use(session) if any(t.gpu_quota is not None for t in quotas.values()) else {}
    for job in jobs:
        attempt = attempts.get(job.current_attempt_id) if job.current_attempt_id else None
        reasons: list[str] = []
        if job.state in JOB_WAITING:
            reasons = _queue_reasons(job, caps)
            quota = quotas.get(job.tenant)
            if quota is not None and quota.gpu_quota is not None:
                used = usage.get(job.tenant, 0)
                if used + job.num_gpus > quota.gpu_quota:
                    reasons.append(f"quota: tenant {job.tenant} uses {used} of its {quota.gpu_quota} GPUs and "
                                   f"the job needs {job.num_gpus}")
            res = held.get(job.id)
            if res is not None:
                reasons.append(_reservation_reason(job, res, caps))
            if not reasons:
                reasons.append("its turn: it fits now and jobs ahead of it in the queue go first")
            if job.state == "recovering" and attempt is not None:
                reasons = _recovery_reasons(attempt) + reasons
        elif job.state == "starting" and attempt is not None:
            reasons = [f"node {p.node.name} to launch node rank {p.node_rank}"
                       for p in attempt.nodes if p.state in PART_UNLAUNCHED and p.released_at is None]
            reasons = reasons or ["every worker to report running"]
            if attempt.number > 1:  # the job is starting its recovery: say so (issue 26)
                reasons[0] = f"recovery (attempt {attempt.number}): {reasons[0]}"
        elif job.state == "cancelling" and attempt is not None:
            reasons = [f"node {p.node.name} to confirm its workers stopped"
                       for p in attempt.nodes if p.released_at is None and p.node.state not in NODE_UNREACHABLE]
        if reasons:
            out[job.id] = "; ".join(reasons)
    return out


def _recovery_reasons(failed: Attempt) -> list[str]:
    """A recovering job's first words: which attempt failed and how, and the nodes of that attempt
    that are lost and so still hold its GPUs (until they return or are removed)."""
    kind = f" ({failed.failure_kind})" if failed.failure_kind else ""
    out = [f"a new attempt: attempt {failed.number} failed{kind}"]
    out += [f"node {p.node.name} ({p.node.state}) to return or be removed: it still holds attempt "
            f"{failed.number}'s GPUs" for p in failed.nodes
            if p.released_at is None and p.node.state in NODE_UNREACHABLE]
    return out


def _reservation_reason(job: Job, res: ReservationOut, caps: list[_NodeCap]) -> str:
    """A reservation in words; an earliest start that has passed is said to have passed, with what
    the job still waits for on the reserved nodes (a lost node, GPUs still in use): never a stale time."""
    held = f"reservation on nodes {', '.join(res.nodes)}"
    if res.earliest_start is None:
        return f"{held}, earliest start unknown (a job it waits for has no time limit)"
    if res.earliest_start > now():
        return f"{held}, earliest start {res.earliest_start.isoformat()}"
    blocking = [_why_not(n) if n.state != "ready" or not n.schedulable
                else f"{n.name} ({n.free} of {n.total} GPUs free)"
                for n in caps if n.name in res.nodes
                and (n.state != "ready" or not n.schedulable or n.free < job.gpus_per_node)]
    return (f"{held}: its estimated start has passed; waiting for "
            + (", ".join(blocking) if blocking else "the next scheduling pass"))


def _kinds_out(kinds: list[str] | None) -> str | list[str] | None:
    """As submitted: one kind as a string, several as a list."""
    if not kinds:
        return None
    return kinds[0] if len(kinds) == 1 else list(kinds)


def _queue_reasons(job: Job, caps: list[_NodeCap]) -> list[str]:
    """Why the cluster cannot place the job now: no node of a kind it accepts, too few usable nodes
    of one kind, or too few of one kind with enough free GPUs (a gang runs on one kind)."""
    k, g, kinds = job.num_nodes, job.gpus_per_node, job.gpu_kinds
    named = f" of kind {' or '.join(kinds)}" if kinds else ""
    by_kind: dict[str, list[_NodeCap]] = {}
    for n in caps:
        if kinds is None or n.kind in kinds:
            by_kind.setdefault(n.kind, []).append(n)
    if not by_kind:
        return [f"no node with GPU kind {' or '.join(kinds)}" if kinds else "no node is registered"]
    one = " of one kind" if len(by_kind) > 1 else ""
    big = [n for ns in by_kind.values() for n in ns if n.total >= g]
    usable = [n for n in big if n.state == "ready" and n.schedulable]
    most = max(sum(1 for n in usable if n.kind == kind) for kind in by_kind)
    if most < k:
        others = [_why_not(n) for n in big if n not in usable]
        return [f"needs {k} nodes{one} with {g} GPUs{named}, the cluster has {most} such nodes that take work"
                + (f" (also {', '.join(others)})" if others else "")]
    most = max(sum(1 for n in usable if n.kind == kind and n.free >= g) for kind in by_kind)
    if most < k:
        return [f"needs {k} nodes{one} with {g} free GPUs{named}, the cluster has {most} such nodes now "
                "(the others' GPUs are in use)"]
    return []


def attempts_page(session: Session, job_id: uuid.UUID, *, limit: int, cursor: str | None,
                  budgets: Mapping[str, float | None] | None = None) -> AttemptPage:
    """The job's attempts, oldest first, ``limit`` at a time (keyset on the attempt number)."""
    after = pages.decode(cursor, int)[0] if cursor else 0
    # The attempt before the page too: the first one's recovery is measured from it.
    rows = list(session.scalars(
        select(Attempt).where(Attempt.job_id == job_id, Attempt.number >= max(after, 1))
        .order_by(Attempt.number).limit(limit + 2)
        .options(
            selectinload(Attempt.nodes).selectinload(AttemptPart.node),
            selectinload(Attempt.nodes).selectinload(AttemptPart.workers),
        )
    ))
    before = rows[0] if rows and rows[0].number == after else None
    page = rows[1:] if before is not None else rows
    more = len(page) > limit
    items = _attempts_out(session, page[:limit], before, budgets)
    return AttemptPage(items=items, next_cursor=pages.encode(page[limit - 1].number) if more else None)


def attempts_out(session: Session, job_id: uuid.UUID,
                 budgets: Mapping[str, float | None] | None = None) -> list[AttemptOut]:
    """Every attempt of the job, oldest first; ``budgets``: the cluster's recovery budgets."""
    attempts = list(session.scalars(
        select(Attempt)
        .where(Attempt.job_id == job_id)
        .order_by(Attempt.number)
        .options(
            selectinload(Attempt.nodes).selectinload(AttemptPart.node),
            selectinload(Attempt.nodes).selectinload(AttemptPart.workers),
        )
    ))
    return _attempts_out(session, attempts, None, budgets)


def job_budgets(session: Session, job_id: uuid.UUID,
                cluster: Mapping[str, float | None] | None) -> dict[str, float | None]:
    """The job's recovery budgets: its watchdog.recovery_budget_s over the cluster's."""
    own = (session.scalar(select(Job.watchdog).where(Job.id == job_id)) or {}).get("recovery_budget_s")
    return recovery_budget.budgets_for(cluster or {}, own)


def _attempts_out(session: Session, attempts: list[Attempt], before: Attempt | None,
                  cluster_budgets: Mapping[str, float | None] | None = None) -> list[AttemptOut]:
    budgets = job_budgets(session, attempts[0].job_id, cluster_budgets) if attempts else {}
    names = dict(session.execute(
        select(Node.id, Node.name).where(Node.id.in_({a.failed_node_id for a in attempts if a.failed_node_id}))
    ).all()) if any(a.failed_node_id for a in attempts) else {}
    chain = [before, *attempts] if before is not None else attempts
    previous: dict[uuid.UUID, Attempt] = {b.id: a for a, b in zip(chain, chain[1:], strict=False)}
    done = {a.id: progress.of_parts(a.nodes) for a in chain}
    return [
        AttemptOut(
            id=str(a.id),
            number=a.number,
            state=a.state,
            outcome=a.outcome,
            end_reason=a.end_reason,
            failed_node=names.get(a.failed_node_id) if a.failed_node_id else None,
            rendezvous=f"{a.rdzv_host}:{a.rdzv_port}",
            restored_from_step=a.restored_from_step,
            progress_step=done[a.id].step,
            hung_since=a.hung_since,
            progress_metrics=done[a.id].metrics or {},
            failure_kind=a.failure_kind,
            recovery=_recovery(previous.get(a.id), a, done, budgets),
            created_at=a.created_at,
            started_at=a.started_at,
            first_progress_at=done[a.id].first_at,
            failed_at=a.failed_at,
            ended_at=a.ended_at,
            nodes=[
                AttemptPartOut(
                    node_id=str(p.node_id),
                    node_name=p.node.name,
                    node_rank=p.node_rank,
                    gpu_indices=list(p.gpu_indices),
                    desired=p.desired,
                    state=p.state,
                    exit_code=p.exit_code,
                    error=p.error,
                    released_at=p.released_at,
                    workers=[_worker_out(p, w) for w in p.workers],
                )
                for p in a.nodes
            ],
        )
        for a in attempts
    ]


def _worker_out(part: AttemptPart, w: Worker) -> WorkerOut:
    """A worker as the attempt view shows it. A released part has no process left (its node said
    so), so a worker without a recorded exit shows as exited, exit code unknown, with the reason."""
    state, reason = w.state, None
    if part.released_at is not None and w.state != "exited":
        state = "exited"
        if part.desired == "stop" or part.state == "stopped":
            reason = "stopped with its node's part; no exit was recorded for this worker"
        else:
            reason = "its node confirmed the part's processes gone; no exit was recorded for this worker"
    return WorkerOut(rank=w.rank, local_rank=w.local_rank, pid=w.pid, state=state, exit_code=w.exit_code,
                     started_at=w.started_at, ended_at=w.ended_at, reason=reason, cause=w.exit_cause,
                     message=w.exit_message)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return round((end - start).total_seconds(), 3) if start is not None and end is not None else None


def _last(values: list[datetime | None]) -> datetime | None:
    """The latest of every part's instant; None unless every part reported one."""
    return None if not values or any(v is None for v in values) else max(v for v in values if v is not None)


def _recovery(prev: Attempt | None, a: Attempt, done: dict[uuid.UUID, progress.Progress],
              budgets: Mapping[str, float | None] | None = None) -> RecoveryOut | None:
    """The phases of the recovery from ``prev``'s failure to ``a``'s first step (recovery_budget.split),
    and those over ``budgets`` (the cluster's, under the job's own)."""
    if prev is None or prev.outcome != "failed" or prev.failed_at is None:
        return None
    exits = [w.ended_at for p in prev.nodes for w in p.workers
             if w.ended_at is not None and w.exit_code not in (0, None)]
    failure_at = min([prev.failed_at, *exits])
    lost = None
    reached = done[prev.id].step
    if reached is not None:
        lost = max(reached - (a.restored_from_step or 0), 0)
    marks = recovery_budget.Marks(
        failure=failure_at, failed=prev.failed_at, created=a.created_at,
        received=_last([p.received_at for p in a.nodes]), running=a.started_at,
        initialised=_last([p.initialized_at for p in a.nodes]), first_step=done[a.id].first_at)
    cut = recovery_budget.split(marks)
    over = recovery_budget.over_budget(cut.phases, budgets or {})
    return RecoveryOut(
        after_attempt=prev.number,
        failure_at=failure_at,
        **{f"{phase}_s": seconds for phase, seconds in cut.phases.items()},
        to_first_step_s=cut.total_s,
        steps_lost=lost,
        budget_s={k: v for k, v in (budgets or {}).items() if v is not None},
        over_budget=[RecoveryOverrunOut(phase=o.phase, seconds=o.seconds, budget_s=o.budget_s) for o in over],
    )


def recovery_of(session: Session, attempt: Attempt,
                budgets: Mapping[str, float | None] | None = None) -> RecoveryOut | None:
    """The recovery ``attempt`` ended with its first step (None: it followed no failure)."""
    # Read again (populate_existing): the other nodes' reports committed what this session has not seen.
    both = {a.number: a for a in session.scalars(
        select(Attempt).where(Attempt.job_id == attempt.job_id, Attempt.number.in_([attempt.number - 1,
                                                                                    attempt.number]))
        .options(selectinload(Attempt.nodes).selectinload(AttemptPart.workers))
        .execution_options(populate_existing=True))}
    prev, attempt = both.get(attempt.number - 1), both.get(attempt.number, attempt)
    done = {a.id: progress.of_parts(a.nodes) for a in (prev, attempt) if a is not None}
    return _recovery(prev, attempt, done, budgets)


def node_out(session: Session, nodes: list[Node]) -> list[NodeOut]:
    ids = [n.id for n in nodes]
    gpus = session.scalars(select(Gpu).where(Gpu.node_id.in_(ids)).order_by(Gpu.index)).all() if ids else []
    leases = {
        lease.gpu_id: lease
        for lease in session.scalars(
            select(GpuLease).where(GpuLease.released_at.is_(None), GpuLease.node_id.in_(ids))
        )
    } if ids else {}
    by_node: dict[uuid.UUID, list[GpuOut]] = {}
    for g in gpus:
        lease = leases.get(g.id)
        by_node.setdefault(g.node_id, []).append(
            GpuOut(index=g.index, uuid=g.uuid, kind=g.kind, memory_mb=g.memory_mb,
                   job_id=_s(lease.job_id) if lease else None,
                   attempt_id=_s(lease.attempt_id) if lease else None)
        )
    busy = {lease.node_id for lease in leases.values()}
    return [
        NodeOut(id=str(n.id), name=n.name, address=n.address, state=n.state, schedulable=n.schedulable,
                scheduling=scheduling_state(n, n.id in busy), labels=n.effective_labels,
                label_overrides=dict(n.label_overrides or {}), last_heartbeat_at=n.last_heartbeat_at,
                registered_at=n.registered_at, gpus=by_node.get(n.id, []))
        for n in nodes
    ]


def events_page(session: Session, job_id: uuid.UUID, *, after: int, limit: int, cursor: str | None) -> EventPage:
    """The job's events after id ``after``, oldest first, ``limit`` at a time (keyset on the id)."""
    if cursor:
        after = max(after, pages.decode(cursor, pages.int64)[0])
    items = events.list_events(session, job_id=job_id, after=after, limit=limit + 1)
    more = len(items) > limit
    return EventPage(items=[event_out(e) for e in items[:limit]],
                     next_cursor=pages.encode(items[limit - 1].id) if more else None)


def progress_page(session: Session, job_id: uuid.UUID, *, limit: int, cursor: str | None) -> ProgressPage:
    rows, next_cursor = progress.samples(session, job_id, limit=limit, cursor=cursor)
    return ProgressPage(items=[ProgressSampleOut(attempt_number=r.attempt_number, step=r.step, loss=r.loss,
                                                 steps_per_s=r.steps_per_s, metrics=dict(r.metrics or {}), at=r.at)
                               for r in rows], next_cursor=next_cursor)


def event_out(e: Event) -> EventOut:
    return EventOut(id=e.id, kind=e.kind, message=e.message, job_id=_s(e.job_id), attempt_id=_s(e.attempt_id),
                    node_id=_s(e.node_id), data=dict(e.data or {}), created_at=e.created_at)


def checkpoints_page(session: Session, job_id: uuid.UUID, *, limit: int, cursor: str | None) -> CheckpointPage:
    """The job's checkpoints, newest first (step, then creation), ``limit`` at a time."""
    where: list[Any] = [Checkpoint.job_id == job_id]
    if cursor:
        step, created, cid = pages.decode(cursor, int, datetime, uuid.UUID)
        where.append(tuple_(Checkpoint.step, Checkpoint.created_at, Checkpoint.id) < tuple_(step, created, cid))
    items = _checkpoints_out(session, where, limit + 1)
    more = len(items) > limit
    last = items[limit - 1] if more else None
    return CheckpointPage(items=items[:limit], next_cursor=pages.encode(
        last.step, last.created_at.isoformat(), last.id) if last is not None else None)


def checkpoints_out(session: Session, job_id: uuid.UUID) -> list[CheckpointOut]:
    return _checkpoints_out(session, [Checkpoint.job_id == job_id], None)


def _checkpoints_out(session: Session, where: list[Any], limit: int | None) -> list[CheckpointOut]:
    shard = CheckpointShard
    shard_counts = (
        select(shard.checkpoint_id, func.count().label("n"),
               func.count(shard.upload_s).label("reported"),
               func.max(shard.upload_wait_s).label("wait_max"), func.avg(shard.upload_wait_s).label("wait_mean"),
               func.max(shard.upload_s).label("upload_max"),
               func.sum(shard.size_bytes).filter(shard.upload_s.is_not(None)).label("bytes"),
               func.sum(shard.upload_s).label("seconds"),
               func.count().filter(shard.upload_slot == "bypassed").label("bypassed"))
        .where(shard.checkpoint_id.in_(select(Checkpoint.id).where(*where)))  # this job's shards only
        .group_by(shard.checkpoint_id)
        .subquery()
    )
    rows = session.execute(
        select(Checkpoint, Attempt.number, shard_counts)
        .join(Attempt, Attempt.id == Checkpoint.attempt_id)
        .outerjoin(shard_counts, shard_counts.c.checkpoint_id == Checkpoint.id)
        .where(*where)
        .order_by(Checkpoint.step.desc(), Checkpoint.created_at.desc(), Checkpoint.id.desc())
        .limit(limit)
    ).all()
    return [
        CheckpointOut(id=str(c.id), step=c.step, attempt_id=str(c.attempt_id), attempt_number=r.number,
                      state=c.state, world_size=c.world_size, size_bytes=c.size_bytes, shards=r.n or 0,
                      manifest_key=c.manifest_key, reason=c.reason, blocking_s=c.blocking_s,
                      background_s=c.background_s,
                      upload_bytes_per_s=round(c.size_bytes / c.background_s, 1) if c.background_s else None,
                      created_at=c.created_at, committed_at=c.committed_at, upload=_upload_out(r))
        for r in rows for c in (r.Checkpoint,)
    ]


def _upload_out(r: Any) -> CheckpointUploadOut | None:
    if not r.reported:
        return None
    seconds = float(r.seconds or 0.0)
    return CheckpointUploadOut(reported=r.reported, wait_s_max=float(r.wait_max or 0.0),
                               wait_s_mean=float(r.wait_mean or 0.0), upload_s_max=float(r.upload_max or 0.0),
                               bytes_per_s=float(r.bytes or 0) / seconds if seconds > 0 else None,
                               bypassed=int(r.bypassed or 0))
