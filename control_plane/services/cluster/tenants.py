"""Tenants: weights and GPU quotas of the teams sharing the cluster.

A job names its tenant at submit. A tenant without a row (never PUT) gets weight 1 and no quota;
rows are not created implicitly, so a typo in a job's tenant does not invent a configuration.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import Unprocessable
from control_plane.models import GpuLease, Job, PrincipalRecord, Tenant
from control_plane.schemas.tenants import TenantIn, TenantOut
from control_plane.services.states import JOB_ACTIVE, JOB_WAITING

DEFAULT_WEIGHT = 1.0
DEFAULT_MAX_PRIORITY = 0
WAITING = JOB_WAITING
RUNNING = JOB_ACTIVE


def all_tenants(session: Session) -> dict[str, Tenant]:
    return {t.name: t for t in session.scalars(select(Tenant))}


def put_tenant(session: Session, name: str, body: TenantIn) -> Tenant:
    """Create or replace a tenant's weight and quota. Lowering a quota below what the tenant uses
    stops nothing (no preemption): its next jobs wait until it is back under."""
    tenant = session.get(Tenant, name, with_for_update={"key_share": True})
    t = now()
    if tenant is None:
        tenant = Tenant(name=name, created_at=t)
        session.add(tenant)
    tenant.weight = body.weight
    tenant.gpu_quota = body.gpu_quota
    tenant.max_priority = body.max_priority
    tenant.updated_at = t
    session.commit()
    return tenant


def check_quota(session: Session, tenant: str, gpus: int) -> None:
    """Refuse a job that its tenant's quota could never admit."""
    quota = session.scalar(select(Tenant.gpu_quota).where(Tenant.name == tenant))
    if quota is not None and gpus > quota:
        raise Unprocessable(
            f"the job needs {gpus} GPUs but tenant {tenant!r} has a quota of {quota} GPUs", field="tenant"
        )


def max_priority(session: Session, tenant: str) -> int:
    """The highest priority the tenant's members may give a job; a tenant without a row: the default."""
    cap = session.scalar(select(Tenant.max_priority).where(Tenant.name == tenant))
    return DEFAULT_MAX_PRIORITY if cap is None else cap


def gpus_in_use(session: Session) -> dict[str, int]:
    rows = session.execute(
        select(Job.tenant, func.count(GpuLease.id))
        .join(GpuLease, GpuLease.job_id == Job.id)
        .where(GpuLease.released_at.is_(None))
        .group_by(Job.tenant)
    )
    return {tenant: n for tenant, n in rows}


def list_tenants(session: Session) -> list[TenantOut]:
    """Configured tenants, every tenant with a principal, and every tenant with jobs, by name."""
    configured = all_tenants(session)
    usage = gpus_in_use(session)
    counts: dict[tuple[str, str], int] = {
        (tenant, state): n
        for tenant, state, n in session.execute(
            select(Job.tenant, Job.state, func.count()).where(Job.state.in_(WAITING + RUNNING))
            .group_by(Job.tenant, Job.state)
        )
    }
    # Also every tenant that has people or has ever run a job: a fresh cluster's `trainyard tenants`
    # lists the teams that use it, not only those an admin configured.
    known = set(session.scalars(select(PrincipalRecord.tenant).distinct())) | set(
        session.scalars(select(Job.tenant).distinct()))
    names = set(configured) | set(usage) | {tenant for tenant, _ in counts} | known
    out = []
    for name in sorted(names):
        row = configured.get(name)
        weight = row.weight if row else DEFAULT_WEIGHT
        used = usage.get(name, 0)
        out.append(TenantOut(
            name=name, weight=weight, gpu_quota=row.gpu_quota if row else None,
            max_priority=row.max_priority if row else DEFAULT_MAX_PRIORITY, configured=row is not None,
            gpus_in_use=used, weighted_share=round(used / weight, 6),
            jobs_waiting=sum(counts.get((name, s), 0) for s in WAITING),
            jobs_running=sum(counts.get((name, s), 0) for s in RUNNING),
        ))
    return out


def tenant_out(session: Session, name: str) -> TenantOut:
    return next(t for t in list_tenants(session) if t.name == name)
