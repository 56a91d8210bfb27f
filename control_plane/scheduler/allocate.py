"""One scheduling pass: read the queue and capacity, ask the policy, apply in one transaction.

Passes from several control-plane replicas are serialized by a transaction-scoped advisory
lock; a replica that cannot take it skips the pass (another is doing the work). Even without
the lock, the database refuses a second lease on a GPU and a partial gang (see models.py).
"""

from __future__ import annotations

import secrets
import uuid

import structlog
from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, Gpu, GpuLease, Job, Node
from control_plane.scheduler.policy import JobDemand, NodeCapacity, Placement, decide
from control_plane.services import attempts
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


def _demand(job: Job) -> JobDemand:
    return JobDemand(
        job_id=str(job.id),
        num_nodes=job.num_nodes,
        gpus_per_node=job.gpus_per_node,
        priority=job.priority,
        submitted_at=job.created_at,
        recovering=job.state == "recovering",
        gpu_kind=job.gpu_kind,
    )


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
    capacity = free_capacity(session)
    decisions = decide([_demand(j) for j in jobs], capacity)
    if not decisions:
        session.rollback()
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
