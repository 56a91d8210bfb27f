"""One scheduling pass: read the queue, the nodes and what runs, ask the policy, apply in one
transaction.

Passes from several control-plane replicas are serialized by a transaction-scoped advisory
lock; a replica that cannot take it skips the pass (another is doing the work). Even without
the lock, the database refuses a second lease on a GPU and a partial gang (see models.py), and
every admitted job is locked and re-checked as still waiting before its attempt is created.

A pass at scale (~10^4 waiting jobs, ~10^3 nodes) reads plain columns (no ORM objects but for the
jobs it admits), groups what runs per node in SQL, and inserts attempts, parts and leases in bulk.
"""

from __future__ import annotations

import dataclasses
import secrets
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import structlog
from sqlalchemy import DateTime, String, Text, and_, case, cast, exists, func, literal, or_, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.models import Attempt, AttemptPart, Gpu, GpuLease, Job, Node
from control_plane.scheduler import handover_policy
from control_plane.scheduler.policy import (
    Decision,
    JobDemand,
    Mode,
    NodeCapacity,
    Placement,
    PlacementRule,
    PolicyOptions,
    Running,
    TenantShare,
    decide,
    place,
)
from control_plane.services.cluster import reservations, tenants
from control_plane.services.read import metrics
from control_plane.services.runs import allocation, attempts, handover
from control_plane.services.runs.limits import ONE_SECOND
from control_plane.services.states import ATTEMPT_HOLDING, ATTEMPT_LIVE, JOB_WAITING, set_job_state
from control_plane.settings import Settings
from trainyard.protocol.exits import NODE_FAULT_KINDS

log = structlog.get_logger("trainyard.scheduler")

SCHEDULER_LOCK = 7212002
WAITING_STATES = JOB_WAITING


class PendingJob(NamedTuple):
    """The columns of a waiting job the policy needs (``pending_jobs`` returns rows of this shape)."""

    id: str
    """The job's id as text: the policy's key (a UUID is made only for the few jobs that need one)."""
    state: str
    num_nodes: int
    gpus_per_node: int
    priority: int
    tenant: str
    gpu_kinds: list[str] | None
    time_limit_s: int | None
    created_at: datetime


_PENDING_COLUMNS = (cast(Job.id, Text).label("id"), Job.state, Job.num_nodes, Job.gpus_per_node, Job.priority,
                    Job.tenant, Job.gpu_kinds, Job.time_limit_s, Job.created_at)


def _waiting() -> Any:
    live = exists().where(Attempt.job_id == Job.id, Attempt.state.in_(ATTEMPT_LIVE))
    return and_(Job.state.in_(WAITING_STATES), or_(Job.state == "queued", ~live))


class PendingCache:
    """What a replica's scheduler keeps between passes: a job's scheduling columns never change
    after submit (only its state does), so a pass reads the ids and states of the waiting jobs and
    the full rows of those it has not seen. Replicas each keep their own; nothing here can go stale."""

    def __init__(self) -> None:
        self.rows: dict[str, PendingJob] = {}
        self.demands: dict[str, JobDemand] = {}  # of queued jobs (recovering ones change each pass)


def pending_jobs(session: Session, cache: PendingCache | None = None) -> Sequence[PendingJob]:
    """Waiting jobs, oldest first. A recovering job whose failed attempt is still live waits.

    Plain result rows (named like ``PendingJob``): a pass reads ~10^4 of them, and every object
    made per row costs (and feeds the garbage collector)."""
    if cache is None:
        rows = session.execute(select(*_PENDING_COLUMNS).where(_waiting()).order_by(Job.created_at, Job.id))
        return rows.all()  # type: ignore[return-value]
    ids = session.execute(
        select(cast(Job.id, Text), Job.state).where(_waiting()).order_by(Job.created_at, Job.id)
    ).all()
    known = cache.rows
    missing = [job_id for job_id, _ in ids if job_id not in known]
    if len(missing) > len(ids) // 2:  # a cold cache: one read of everything beats long IN lists
        for fetched in session.execute(select(*_PENDING_COLUMNS).where(_waiting())):
            known[fetched.id] = PendingJob(*fetched)
        missing = []
    for start in range(0, len(missing), 5000):
        chunk = [uuid.UUID(j) for j in missing[start:start + 5000]]
        for fetched in session.execute(select(*_PENDING_COLUMNS).where(Job.id.in_(chunk))):
            known[fetched.id] = PendingJob(*fetched)
    out: list[PendingJob] = []
    for job_id, state in ids:
        job = known.get(job_id)
        if job is None:  # it left the queue between the two reads
            continue
        out.append(job if job.state == state else job._replace(state=state))
    cache.rows = {job.id: job for job in out}
    cache.demands = {k: d for k, d in cache.demands.items() if k in cache.rows}
    return out


class NodeRef(NamedTuple):
    """What creating an attempt needs of a node."""

    id: uuid.UUID
    name: str
    address: str


@dataclass
class ClusterState:
    """Schedulable nodes with their free GPUs and what runs on them; GPUs in use per tenant."""

    capacity: list[NodeCapacity]
    nodes: dict[str, NodeRef]
    usage: dict[str, int]


def cluster_state(session: Session, at: datetime, *, label_key: str | None = None) -> ClusterState:
    """One row per schedulable node (its free GPU indices aggregated in SQL), and what runs."""
    label = (func.coalesce(Node.label_overrides[label_key].astext, Node.labels[label_key].astext)
             if label_key else literal(None, String))
    node_rows = session.execute(
        select(Node.id, Node.name, Node.address, label, func.min(Gpu.kind), func.count(Gpu.id),
               func.array_agg(Gpu.index).filter(GpuLease.id.is_(None)))
        .join(Gpu, Gpu.node_id == Node.id)
        .outerjoin(GpuLease, and_(GpuLease.gpu_id == Gpu.id, GpuLease.released_at.is_(None)))
        .where(Node.state == "ready", Node.schedulable.is_(True))
        .group_by(Node.id)
        .order_by(Node.name)
    ).all()
    # What holds GPUs, per node: released at the attempt's allocation + its job's time limit
    # (services/runs/limits.py stops it then), at once if it is already stopping, never without a limit.
    ends = case(
        (Attempt.outcome.is_not(None), literal(at, DateTime(timezone=True))),
        (Job.time_limit_s.is_not(None),
         func.greatest(literal(at, DateTime(timezone=True)), Attempt.created_at + Job.time_limit_s * ONE_SECOND)),
        else_=None,
    ).label("ends")
    running: dict[uuid.UUID, list[Running]] = {}
    usage: Counter[str] = Counter()
    for node_id, ends_at, tenant, n in session.execute(
        select(GpuLease.node_id, ends, Job.tenant, func.count())
        .join(Attempt, Attempt.id == GpuLease.attempt_id)
        .join(Job, Job.id == GpuLease.job_id)
        .where(GpuLease.released_at.is_(None))
        .group_by(GpuLease.node_id, ends, Job.tenant)
    ):
        running.setdefault(node_id, []).append(Running(gpus=n, ends_at=ends_at))
        usage[tenant] += n
    capacity = [
        NodeCapacity(node_id=str(node_id), name=name, free=tuple(sorted(free or ())), total=total, gpu_kind=kind,
                     labels={label_key: value} if label_key and value is not None else {},
                     running=tuple(running.get(node_id, ())))
        for node_id, name, _, value, kind, total, free in node_rows
    ]
    refs = {str(node_id): NodeRef(node_id, name, address) for node_id, name, address, *_ in node_rows}
    return ClusterState(capacity=capacity, nodes=refs, usage=dict(usage))


def free_capacity(session: Session, *, label_key: str | None = "rack") -> list[NodeCapacity]:
    """Every schedulable node's free GPUs (and what runs on it) now."""
    return cluster_state(session, now(), label_key=label_key).capacity


@dataclass(frozen=True)
class RecoveryHistory:
    """What a recovering job's earlier attempts say about where to place the next one."""

    prefer: frozenset[str] = frozenset()
    """Nodes of the last attempt that were not blamed for its failure."""
    avoid: frozenset[str] = frozenset()
    """Nodes blamed for AVOID_AFTER_FAILURES or more of the job's failures."""
    gpu_kind: str | None = None
    """The GPU kind the job ran on: a recovery replaces GPUs with GPUs of the same kind."""


# A node blamed for this many failures of one job is not used for that job again.
AVOID_AFTER_FAILURES = 2


def recovery_history(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, RecoveryHistory]:
    if not job_ids:
        return {}
    # Only the node's own failures count against it (NODE_FAULT_KINDS): a job's exception on a
    # healthy node must not make it avoid that node (issue 26).
    rows = [
        (job_id, attempt_id, number, failed_node if kind in NODE_FAULT_KINDS else None)
        for job_id, attempt_id, number, failed_node, kind in session.execute(
            select(Attempt.job_id, Attempt.id, Attempt.number, Attempt.failed_node_id, Attempt.failure_kind)
            .where(Attempt.job_id.in_(job_ids))
            .order_by(Attempt.job_id, Attempt.number)
        )
    ]
    slow = _stragglers_to_avoid(session, job_ids)
    last: dict[uuid.UUID, uuid.UUID] = {}
    blamed: dict[uuid.UUID, Counter[str]] = {}
    for job_id, attempt_id, _number, failed_node in rows:
        last[job_id] = attempt_id
        if failed_node is not None:
            blamed.setdefault(job_id, Counter())[str(failed_node)] += 1
    last_nodes: dict[uuid.UUID, set[str]] = {}
    kinds: dict[uuid.UUID, str] = {}
    if last:
        for attempt_id, node_id, kind in session.execute(
            select(AttemptPart.attempt_id, AttemptPart.node_id, Gpu.kind)
            .join(Gpu, Gpu.node_id == AttemptPart.node_id)
            .where(AttemptPart.attempt_id.in_(list(last.values())), Gpu.index == AttemptPart.gpu_indices[1])
        ):
            last_nodes.setdefault(attempt_id, set()).add(str(node_id))
            kinds[attempt_id] = kind
    failed_node_of = {attempt_id: failed for _, attempt_id, _, failed in rows}
    out = {}
    for job_id, attempt_id in last.items():
        counts = blamed.get(job_id, Counter())
        avoid = frozenset(n for n, c in counts.items() if c >= AVOID_AFTER_FAILURES) | slow.get(attempt_id, set())
        failed = failed_node_of.get(attempt_id)
        prefer = frozenset(last_nodes.get(attempt_id, set()) - avoid - ({str(failed)} if failed else set()))
        out[job_id] = RecoveryHistory(prefer=prefer, avoid=avoid, gpu_kind=kinds.get(attempt_id))
    return out


def _stragglers_to_avoid(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, frozenset[str]]:
    """Per attempt, its nodes named stragglers, for the jobs whose watchdog asks to avoid them
    (``avoid_stragglers``): the next recovery places the job elsewhere."""
    rows = session.execute(
        select(AttemptPart.attempt_id, AttemptPart.node_id)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id).join(Job, Job.id == Attempt.job_id)
        .where(Attempt.job_id.in_(job_ids), AttemptPart.straggler_named_at.is_not(None),
               Job.watchdog["avoid_stragglers"].as_boolean().is_(True))
    ).all()
    out: dict[uuid.UUID, set[str]] = {}
    for attempt_id, node_id in rows:
        out.setdefault(attempt_id, set()).add(str(node_id))
    return {a: frozenset(n) for a, n in out.items()}


NO_HISTORY = RecoveryHistory()


def _cached_demand(cache: PendingCache, job: PendingJob) -> JobDemand:
    demand = cache.demands.get(job.id)
    if demand is None:
        demand = cache.demands[job.id] = _demand(job)
    return demand


def _demand(job: PendingJob | Job, history: RecoveryHistory | None = None) -> JobDemand:
    history = history or NO_HISTORY
    kinds = frozenset(job.gpu_kinds) if job.gpu_kinds else None
    if history.gpu_kind is not None and (kinds is None or history.gpu_kind in kinds):
        kinds = frozenset({history.gpu_kind})  # a recovery replaces GPUs with GPUs of the kind it ran on
    return JobDemand(
        job_id=str(job.id),
        num_nodes=job.num_nodes,
        gpus_per_node=job.gpus_per_node,
        priority=job.priority,
        submitted_at=job.created_at,
        recovering=job.state == "recovering",
        gpu_kinds=kinds,
        avoid_nodes=history.avoid,
        prefer_nodes=history.prefer,
        tenant=job.tenant,
        time_limit_s=job.time_limit_s,
    )


def all_capacity(session: Session) -> list[NodeCapacity]:
    """Every GPU of every node that is not removed, as if all were free: what could ever fit."""
    rows = session.execute(
        select(Node.id, Node.name, Gpu.index, Gpu.kind).join(Gpu, Gpu.node_id == Node.id)
        .where(Node.state != "removed").order_by(Node.name, Gpu.index)
    ).all()
    by_node: dict[uuid.UUID, tuple[str, list[int], str]] = {}
    for node_id, name, index, kind in rows:
        by_node.setdefault(node_id, (name, [], kind))[1].append(index)
    return [NodeCapacity(node_id=str(nid), name=name, free=tuple(ix), total=len(ix), gpu_kind=kind)
            for nid, (name, ix, kind) in by_node.items()]


def _fail_unplaceable(
    session: Session, jobs: Sequence[PendingJob], demands: dict[str, JobDemand]
) -> Sequence[PendingJob]:
    """Fail recovering jobs that avoiding their twice-failed nodes leaves nowhere to run."""
    # Only recovering jobs avoid nodes; the queue may hold thousands of others.
    if not any(demands[str(j.id)].avoid_nodes for j in jobs if j.state == "recovering"):
        return jobs
    everything = all_capacity(session)
    names = {n.node_id: n.name for n in everything}
    kept = []
    for job in jobs:
        demand = demands[str(job.id)]
        if demand.avoid_nodes and place(demand, everything) is None:
            locked = session.get(Job, uuid.UUID(str(job.id)), with_for_update={"key_share": True},
                                 populate_existing=True)
            if locked is not None and locked.state == "recovering":
                avoided = ", ".join(sorted(names.get(n, n) for n in demand.avoid_nodes))
                set_job_state(session, locked, "failed",
                              f"the cluster cannot hold the job without {avoided}, which failed it twice each")
            continue
        kept.append(job)
    return kept


def _ports_in_use(session: Session, hosts: set[str]) -> set[tuple[str, int]]:
    """(host, port) of every attempt on these hosts that may still listen: a port is unique on its
    host only (read through the partial index on active ports: a busy cluster holds thousands)."""
    return {
        (host, port) for host, port in session.execute(
            select(Attempt.rdzv_host, Attempt.rdzv_port)
            .where(Attempt.state.in_(ATTEMPT_HOLDING), Attempt.rdzv_host.in_(sorted(hosts))))
    }


def _pick_port(used: set[tuple[str, int]], host: str, settings: Settings, seed: int) -> int:
    span = settings.rdzv_port_max - settings.rdzv_port_min + 1
    for i in range(span):
        port = settings.rdzv_port_min + (seed + i) % span
        if (host, port) not in used:
            used.add((host, port))
            return port
    raise RuntimeError(f"no free rendezvous port on {host} in the configured range")


PASS_LOCK_BUSY = "scheduler.pass_lock_busy"
"""session.info key set by a pass that found another pass holding the lock (and did nothing)."""


def _try_lock(session: Session) -> bool:
    """The pass lock, held until the transaction ends: one replica schedules at a time."""
    return bool(session.scalar(select(func.pg_try_advisory_xact_lock(SCHEDULER_LOCK))))


def policy_options(settings: Settings, mode: Mode = "fair", placement: PlacementRule = "scored") -> PolicyOptions:
    reserve = settings.recovery_reserve_nodes
    return PolicyOptions(
        mode=mode,
        placement=placement,
        max_reservations=settings.max_reservations,
        topology_label=settings.topology_label or None,
        recovery_reserve=reserve if isinstance(reserve, dict) else {},
        recovery_reserve_default=reserve if isinstance(reserve, int) else 0,
    )


def schedule_pass(
    session: Session, settings: Settings, *, mode: Mode = "fair", placement: PlacementRule = "scored",
    cache: PendingCache | None = None,
) -> list[Placement]:
    """Run one pass in the caller's session; commits what it decided and returns the gangs admitted.

    ``mode`` other than "fair" and ``placement`` "first-fit" run the baselines bench/scheduler.py
    compares against.
    ``cache``: the waiting jobs' columns kept between this replica's passes (``PendingCache``).
    """
    if not _try_lock(session):
        session.info[PASS_LOCK_BUSY] = True  # the caller may pass again once the holder is done
        session.rollback()
        return []
    at = now()
    jobs = pending_jobs(session, cache)
    options = policy_options(settings, mode, placement)
    reserve_on = bool(options.recovery_reserve_default or any(options.recovery_reserve.values()))
    if not jobs and not reserve_on and not reservations.has_active(session):
        session.rollback()
        return []
    history = {str(job_id): h for job_id, h in recovery_history(
        session, [uuid.UUID(j.id) for j in jobs if j.state == "recovering"]).items()}
    queue = [_cached_demand(cache, j) if j.state == "queued" and cache is not None
             else _demand(j, history.get(j.id)) for j in jobs]
    demands = {d.job_id: d for d in queue}
    kept = _fail_unplaceable(session, jobs, demands)
    if len(kept) != len(jobs):
        ids = {str(j.id) for j in kept}
        queue = [d for d in queue if d.job_id in ids]
    state = cluster_state(session, at, label_key=options.topology_label)
    configured = tenants.all_tenants(session)
    previous = reservations.previous(session)
    handovers = _plan_handovers(session, queue, state, options, previous=previous, configured=configured,
                                passing=settings.recovery_pass_leases)
    queue = [d for d in queue if d.job_id not in handovers]
    shares = {
        name: TenantShare(weight=row.weight if row else 1.0, gpu_quota=row.gpu_quota if row else None,
                          gpus_in_use=state.usage.get(name, 0))
        for name in set(configured) | set(state.usage) | {d.tenant for d in queue}
        for row in [configured.get(name)]
    }
    decision = decide(queue, state.capacity, now=at, tenants=shares,
                      previous=previous, options=options,
                      previous_starts=reservations.previous_starts(session))
    admitted = _admit(session, settings, [h.placement for h in handovers.values()] + decision.placements,
                      state.nodes, handovers)
    _account(session, at, decision, admitted, state)
    session.commit()
    # Parked parts handed over: the old attempts ended with them (handover.release_adopted); this
    # only finishes a cancelling job, as after any release.
    released = attempts.released_attempts(session)
    if released:
        attempts.finish_released(session, released)
        session.commit()
    if admitted:
        log.info("scheduled", admitted=len(admitted), reservations=len(decision.reservations),
                 jobs=[p.job_id for p in admitted[:20]])
    return admitted


def _plan_handovers(session: Session, queue: list[JobDemand], state: ClusterState, options: PolicyOptions, *,
                    previous: Mapping[str, Sequence[str]], configured: Mapping[str, Any],
                    passing: bool = True) -> dict[str, PlannedHandover]:
    """The recovering jobs placed onto their own failed attempt's GPUs first, by job id: a restartable
    job's parked parts (handed over with their workers), and with ``passing`` a job that parks
    nothing onto its stopping parts (their leases passed: services/runs/handover.py). Each sees
    those GPUs as free, and only it (scheduler/handover_policy.py); the pass then places the others
    on what is left. The GPUs a handover needs besides those respect what the pass would: other
    jobs' reservations (``previous``) and recovering jobs' healthy nodes, and the tenant's quota
    (``configured``)."""
    recovering = {d.job_id: d for d in queue if d.recovering}
    if not recovering:
        return {}
    ids = [uuid.UUID(j) for j in recovering]
    parked = handover.parked_parts(session, ids)
    stopping = handover.passable_parts(session, ids) if passing else {}
    planned: dict[str, PlannedHandover] = {}
    usage = state.usage  # the pass after it counts what the handovers took
    # A job parks or passes, never both (services/runs/parking.py: parks_nothing).
    for passes, (job_id, parts) in [*((False, j) for j in parked.items()), *((True, j) for j in stopping.items())]:
        demand = recovering[str(job_id)]
        held = {n for other, nodes in previous.items() if other != demand.job_id for n in nodes}
        held |= {n for d in recovering.values() if d.job_id != demand.job_id for n in d.prefer_nodes}
        row = configured.get(demand.tenant)
        quota = getattr(row, "gpu_quota", None)
        plan = handover_policy.plan_handover(
            demand, state.capacity, {n: p.gpu_indices for n, p in parts.items()},
            topology_label=options.topology_label, held=held,
            quota_left=None if quota is None else quota - usage.get(demand.tenant, 0))
        if plan is None:
            continue
        taken = {n: parts[n] for n in plan.adopted}
        planned[demand.job_id] = (PlannedHandover(plan.placement, {}, taken) if passes
                                  else PlannedHandover(plan.placement, taken))
        state.capacity = handover_policy.without(state.capacity, plan.placement)
        extra = sum(len(ix) for n, ix in plan.placement.nodes if n not in plan.adopted)
        usage[demand.tenant] = usage.get(demand.tenant, 0) + extra
    return planned


@dataclass(frozen=True)
class PlannedHandover:
    placement: Placement
    adopted: dict[str, handover.ParkedPart]
    """Node id -> the parked part the new attempt takes over there."""
    passed: dict[str, handover.ParkedPart] = dataclasses.field(default_factory=dict)
    """Node id -> the stopping part whose leases the new attempt takes there (its part follows it)."""


def _admit(session: Session, settings: Settings, placements: list[Placement],
           nodes: dict[str, NodeRef], handovers: dict[str, PlannedHandover] | None = None) -> list[Placement]:
    """Create the attempts of the placements whose jobs are still waiting (locked, re-checked); a
    handover's job first takes its parked parts over (services/runs/handover.py; nodes, then jobs, then
    parts: the lock order), or is left for the next pass if one of them is no longer parked."""
    handovers = handovers or {}
    if not placements:
        return []
    # Lock the placements' nodes first (node -> job, the documented order; FOR NO KEY UPDATE, which
    # the new rows' foreign-key checks do not conflict with) and re-check them: a node declared lost
    # or cordoned since the pass read the cluster gets nothing, and a node this pass places work on
    # cannot be declared lost before the pass commits (mark_lost_nodes skips it while it is locked
    # and sees the attempts placed here on its next round).
    node_ids = sorted({uuid.UUID(n) for p in placements for n, _ in p.nodes})
    usable = {
        str(node_id)
        for node_id, state, schedulable in session.execute(
            select(Node.id, Node.state, Node.schedulable).where(Node.id.in_(node_ids))
            .order_by(Node.id).with_for_update(key_share=True)
        )
        if state == "ready" and schedulable
    }
    placements = [p for p in placements if all(n in usable for n, _ in p.nodes)]
    if not placements:
        return []
    locked = {
        str(job.id): job
        for job in session.scalars(
            select(Job).where(Job.id.in_([uuid.UUID(p.job_id) for p in placements]))
            .order_by(Job.id).with_for_update(key_share=True)  # jobs in id order (services/locks.py)
        )
        if job.state in WAITING_STATES
    }
    admitted = [p for p in placements if p.job_id in locked]
    adopts: dict[uuid.UUID, dict[uuid.UUID, uuid.UUID]] = {}
    follows: dict[uuid.UUID, dict[uuid.UUID, uuid.UUID]] = {}
    for p in [p for p in admitted if p.job_id in handovers]:
        planned, job = handovers[p.job_id], locked[p.job_id]
        if planned.passed:
            got = handover.pass_leases(session, job, planned.passed, dict(p.nodes))
            if got is None:
                admitted.remove(p)
                continue
            follows[job.id] = got
            continue
        if not handover.take_over(session, job, planned.adopted, dict(p.nodes)):
            admitted.remove(p)
            continue
        adopts[job.id] = {part.node_id: part.attempt_id for part in planned.adopted.values()}
    used_ports = _ports_in_use(session, {nodes[p.nodes[0][0]].address for p in admitted})
    # A random start spreads attempts over the range, so a port a just-ended attempt (or another
    # cluster on the same machine) still holds is unlikely to be picked again at once.
    seed = secrets.randbelow(settings.rdzv_port_max - settings.rdzv_port_min + 1)
    t = now()
    for p in admitted:  # since it entered the queue (submitted, or failed over to recovering)
        job = locked[p.job_id]
        metrics.QUEUE_WAIT.labels(kind="recovery" if job.state == "recovering" else "first").observe(
            max((t - job.updated_at).total_seconds(), 0.0))
    allocation.create_attempts(session, [
        (locked[p.job_id], [(nodes[node_id], ix) for node_id, ix in p.nodes],
         _pick_port(used_ports, nodes[p.nodes[0][0]].address, settings, seed + i))
        for i, p in enumerate(admitted)
    ], adopts=adopts, follows=follows, topology_label=settings.topology_label)
    return admitted


def _account(session: Session, at: datetime, decision: Decision, admitted: list[Placement],
             state: ClusterState) -> None:
    """Write the pass's holds and their idle cost (services/cluster/reservations.py)."""
    kind_of = {n.node_id: n.gpu_kind for n in state.capacity}
    served: Counter[str] = Counter(kind_of[p.nodes[0][0]] for p in admitted if p.from_reserve)
    reservations.record(
        session,
        at=at,
        holds=[
            reservations.JobHold(job_id=uuid.UUID(r.job_id), node_ids=[uuid.UUID(n) for n in r.node_ids],
                                 earliest_start=r.earliest_start, held_gpus=r.held_gpus)
            for r in decision.reservations
        ],
        reserve=[
            reservations.ReserveRecord(gpu_kind=h.gpu_kind, node_ids=[uuid.UUID(n) for n in h.node_ids],
                                     idle_gpus=h.idle_gpus, served=served[h.gpu_kind])
            for h in decision.recovery_reserve
        ],
        started={uuid.UUID(p.job_id) for p in admitted},
        waiting=decision.waiting.keys(),
    )
