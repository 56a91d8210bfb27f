"""One scheduling pass: read the queue and capacity, ask the policy, apply in one transaction.

Passes from several control-plane replicas are serialized by a transaction-scoped advisory
lock; a replica that cannot take it skips the pass (another is doing the work). Even without
the lock, the database refuses a second lease on a GPU and a partial gang (see models.py).
"""

from __future__ import annotations

import secrets
import uuid
from collections import Counter
from dataclasses import dataclass

import structlog
from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptNode, Gpu, GpuLease, Job, Node
from control_plane.scheduler.policy import JobDemand, NodeCapacity, Placement, decide, place
from control_plane.services import attempts
from control_plane.services.jobs import set_job_state
from control_plane.settings import Settings

log = structlog.get_logger("trainyard.scheduler")

SCHEDULER_LOCK = 7212002
WAITING_STATES = ("queued", "recovering")


def pending_jobs(session: Session) -> list[Job]:
    has_live_attempt = exists().where(Attempt.job_id == Job.id, Attempt.state.in_(("starting", "running")))
    return list(
        session.scalars(
            select(Job).where(Job.state.in_(WAITING_STATES), ~has_live_attempt).order_by(Job.created_at)
        )
    )


def free_capacity(session: Session) -> list[NodeCapacity]:
    leased = select(GpuLease.gpu_id).where(GpuLease.released_at.is_(None))
    rows = session.execute(
        select(Node, Gpu)
        .join(Gpu, Gpu.node_id == Node.id)
        .where(Node.state == "ready", Node.schedulable.is_(True))
        .order_by(Node.name, Gpu.index)
    ).all()
    leased_ids = set(session.scalars(leased))
    by_node: dict[uuid.UUID, tuple[Node, list[Gpu]]] = {}
    for node, gpu in rows:
        by_node.setdefault(node.id, (node, []))[1].append(gpu)
    return [
        NodeCapacity(
            node_id=str(node.id),
            name=node.name,
            free=tuple(g.index for g in gpus if g.id not in leased_ids),
            total=len(gpus),
            gpu_kind=gpus[0].kind if gpus else "",
            labels=dict(node.labels or {}),
        )
        for node, gpus in by_node.values()
    ]


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
    rows = session.execute(
        select(Attempt.job_id, Attempt.id, Attempt.number, Attempt.failed_node_id)
        .where(Attempt.job_id.in_(job_ids))
        .order_by(Attempt.job_id, Attempt.number)
    ).all()
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
            select(AttemptNode.attempt_id, AttemptNode.node_id, Gpu.kind)
            .join(Gpu, Gpu.node_id == AttemptNode.node_id)
            .where(AttemptNode.attempt_id.in_(list(last.values())), Gpu.index == AttemptNode.gpu_indices[1])
        ):
            last_nodes.setdefault(attempt_id, set()).add(str(node_id))
            kinds[attempt_id] = kind
    failed_node_of = {attempt_id: failed for _, attempt_id, _, failed in rows}
    out = {}
    for job_id, attempt_id in last.items():
        counts = blamed.get(job_id, Counter())
        avoid = frozenset(n for n, c in counts.items() if c >= AVOID_AFTER_FAILURES)
        failed = failed_node_of.get(attempt_id)
        prefer = frozenset(last_nodes.get(attempt_id, set()) - avoid - ({str(failed)} if failed else set()))
        out[job_id] = RecoveryHistory(prefer=prefer, avoid=avoid, gpu_kind=kinds.get(attempt_id))
    return out


def _demand(job: Job, history: RecoveryHistory | None = None) -> JobDemand:
    history = history or RecoveryHistory()
    return JobDemand(
        job_id=str(job.id),
        num_nodes=job.num_nodes,
        gpus_per_node=job.gpus_per_node,
        priority=job.priority,
        submitted_at=job.created_at,
        recovering=job.state == "recovering",
        gpu_kind=job.gpu_kind or history.gpu_kind,
        avoid_nodes=history.avoid,
        prefer_nodes=history.prefer,
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


def _fail_unplaceable(session: Session, jobs: list[Job], demands: dict[str, JobDemand]) -> list[Job]:
    """Fail recovering jobs that avoiding their twice-failed nodes leaves nowhere to run."""
    avoiding = [j for j in jobs if demands[str(j.id)].avoid_nodes]
    if not avoiding:
        return jobs
    everything = all_capacity(session)
    names = {n.node_id: n.name for n in everything}
    kept = []
    for job in jobs:
        demand = demands[str(job.id)]
        if demand.avoid_nodes and place(demand, everything) is None:
            locked = session.get(Job, job.id, with_for_update=True)
            if locked is not None and locked.state == "recovering":
                avoided = ", ".join(sorted(names.get(n, n) for n in demand.avoid_nodes))
                set_job_state(session, locked, "failed",
                              f"the cluster cannot hold the job without {avoided}, which failed it twice each")
            continue
        kept.append(job)
    return kept


def _ports_in_use(session: Session) -> set[int]:
    return set(
        session.scalars(select(Attempt.rdzv_port).where(Attempt.state.in_(("starting", "running", "stopping"))))
    )


def _pick_port(used: set[int], settings: Settings, seed: int) -> int:
    span = settings.rdzv_port_max - settings.rdzv_port_min + 1
    for i in range(span):
        port = settings.rdzv_port_min + (seed + i) % span
        if port not in used:
            used.add(port)
            return port
    raise RuntimeError("no free rendezvous port in the configured range")


def schedule_pass(session: Session, settings: Settings) -> list[Placement]:
    """Run one pass in the caller's session; commits what it decided."""
    if not session.scalar(select(func.pg_try_advisory_xact_lock(SCHEDULER_LOCK))):
        session.rollback()
        return []
    jobs = pending_jobs(session)
    if not jobs:
        session.rollback()
        return []
    history = recovery_history(session, [j.id for j in jobs if j.state == "recovering"])
    demands = {str(j.id): _demand(j, history.get(j.id)) for j in jobs}
    jobs = _fail_unplaceable(session, jobs, demands)
    capacity = free_capacity(session)
    decisions = decide([demands[str(j.id)] for j in jobs], capacity)
    if not decisions:
        session.commit()  # what _fail_unplaceable decided, if anything
        return []
    nodes = {str(n.id): n for n in session.scalars(select(Node).where(Node.state == "ready"))}
    used_ports = _ports_in_use(session)
    # A random start spreads attempts over the range, so a port a just-ended attempt (or another
    # cluster on the same machine) still holds is unlikely to be picked again at once.
    seed = secrets.randbelow(settings.rdzv_port_max - settings.rdzv_port_min + 1)
    for i, p in enumerate(decisions):
        job = session.get(Job, uuid.UUID(p.job_id), with_for_update=True)
        if job is None or job.state not in WAITING_STATES:
            continue
        placement = [(nodes[node_id], ix) for node_id, ix in p.nodes]
        attempts.create_attempt(session, job, placement, rdzv_port=_pick_port(used_ports, settings, seed + i))
    session.commit()
    if decisions:
        log.info("scheduled", admitted=len(decisions), jobs=[p.job_id for p in decisions])
    return decisions
