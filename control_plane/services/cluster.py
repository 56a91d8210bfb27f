"""Cluster summary: capacity, utilization and the queue."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.models import Gpu, GpuLease, Job, Node
from control_plane.schemas.nodes import CapacityOut, ClusterOut, QueuedJobOut
from control_plane.services.jobs import now

QUEUE_STATES = ("recovering", "queued")


def summary(session: Session, *, queue_limit: int = 50) -> ClusterOut:
    nodes = session.execute(
        select(Node.state, Node.schedulable, func.count(Gpu.id))
        .outerjoin(Gpu, Gpu.node_id == Node.id)
        .where(Node.state != "removed")
        .group_by(Node.id)
    ).all()
    in_use = session.scalar(select(func.count(GpuLease.id)).where(GpuLease.released_at.is_(None))) or 0
    total = sum(n for _, _, n in nodes)
    allocatable = sum(n for state, sched, n in nodes if state == "ready" and sched)
    capacity = CapacityOut(
        nodes_total=len(nodes),
        nodes_ready=sum(1 for s, _, _ in nodes if s == "ready"),
        nodes_lost=sum(1 for s, _, _ in nodes if s == "lost"),
        gpus_total=total,
        gpus_allocatable=allocatable,
        gpus_in_use=in_use,
        gpus_free=max(allocatable - in_use, 0),
        utilization=round(in_use / allocatable, 4) if allocatable else 0.0,
    )
    by_state = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    queued = session.scalars(
        select(Job)
        .where(Job.state.in_(QUEUE_STATES))
        .order_by((Job.state == "recovering").desc(), Job.priority.desc(), Job.created_at)
        .limit(queue_limit)
    ).all()
    t = now()
    queue = [
        QueuedJobOut(
            id=str(j.id), name=j.name, state=j.state, gpus=j.num_gpus, priority=j.priority,
            position=i + 1, waiting_s=round((t - j.created_at).total_seconds(), 3),
        )
        for i, j in enumerate(queued)
    ]
    return ClusterOut(capacity=capacity, jobs_by_state=by_state, queue=queue)
