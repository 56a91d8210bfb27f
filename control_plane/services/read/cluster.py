"""Cluster summary: capacity, utilization, the queue in service order, and the scheduler's holds."""

from __future__ import annotations

import heapq
import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.models import Gpu, GpuLease, Job, Node
from control_plane.schemas.nodes import CapacityOut, ClusterOut, QueuedJobOut
from control_plane.services.cluster import reservations, tenants
from control_plane.services.read import goodput
from control_plane.services.states import JOB_TERMINAL, JOB_WAITING

QUEUE_STATES = JOB_WAITING


def summary(session: Session, *, queue_limit: int = 50, tenant: str | None = None) -> ClusterOut:
    """Capacity, jobs by state, the queue in service order and the scheduler's holds. ``tenant``:
    the view of a member or viewer: capacity as it is, jobs, queue and reservations of that tenant
    only (positions stay the cluster-wide ones)."""
    nodes = session.execute(
        select(Node.state, Node.schedulable, func.count(Gpu.id))
        .outerjoin(Gpu, Gpu.node_id == Node.id)
        .where(Node.state != "removed")
        .group_by(Node.id)
    ).all()
    in_use = session.scalar(select(func.count(GpuLease.id)).where(GpuLease.released_at.is_(None))) or 0
    releasing = session.scalar(
        select(func.count(GpuLease.id)).join(Job, Job.id == GpuLease.job_id)
        .where(GpuLease.released_at.is_(None), Job.state.in_(JOB_TERMINAL))
    ) or 0
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
        gpus_releasing=releasing,
    )
    counted = select(Job.state, func.count()).group_by(Job.state)
    if tenant is not None:
        counted = counted.where(Job.tenant == tenant)
    by_state = dict(session.execute(counted).all())
    t = now()
    queue = [
        QueuedJobOut(
            id=str(j.id), name=j.name, state=j.state, gpus=j.num_gpus, priority=j.priority, tenant=j.tenant,
            position=i + 1, waiting_s=round((t - j.created_at).total_seconds(), 3),
        )
        for i, j in enumerate(_service_order(session, queue_limit))
        if tenant is None or j.tenant == tenant
    ]
    scheduling = reservations.summary(session)
    figures = goodput.for_cluster(session, scheduling, tenant=tenant)
    if tenant is not None:
        own = {str(i) for i in session.scalars(select(Job.id).where(
            Job.id.in_([uuid.UUID(r.job_id) for r in scheduling.reservations]), Job.tenant == tenant))}
        scheduling.reservations = [r for r in scheduling.reservations if r.job_id in own]
    return ClusterOut(capacity=capacity, jobs_by_state=by_state, queue=queue, scheduling=scheduling,
                      goodput=figures)


def _service_order(session: Session, limit: int) -> list[Job]:
    """The first waiting jobs in the order the next pass serves them: recovering, priority, the
    tenant's weighted share of GPUs in use (scheduler/policy.py), submit time."""
    rows = session.execute(
        select(Job.id, Job.state, Job.priority, Job.tenant, Job.created_at).where(Job.state.in_(QUEUE_STATES))
    ).all()
    weights = {name: t.weight for name, t in tenants.all_tenants(session).items()}
    usage = tenants.gpus_in_use(session)

    def key(row: Any) -> tuple[bool, int, float, datetime, uuid.UUID]:
        recovering = row.state == "recovering"  # they held a place: shares do not reorder them
        share = 0.0 if recovering else usage.get(row.tenant, 0) / weights.get(row.tenant, tenants.DEFAULT_WEIGHT)
        return (not recovering, -row.priority, share, row.created_at, row.id)

    first = [row.id for row in heapq.nsmallest(limit, rows, key=key)]
    by_id = {j.id: j for j in session.scalars(select(Job).where(Job.id.in_(first)))} if first else {}
    return [by_id[i] for i in first if i in by_id]
