"""/v1/tenants: weights, quotas and priority caps of the teams sharing the cluster (operators)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from control_plane.api.deps import RuntimeDep, SessionDep, TenantsManage, TenantsRead, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.tenants import TENANT_NAME, TenantIn, TenantOut
from control_plane.services.cluster import tenants

router = APIRouter(prefix="/v1/tenants", tags=["tenants"], route_class=TransactionRoute)

TenantName = Annotated[str, Path(min_length=1, max_length=128, pattern=TENANT_NAME)]


@router.get("", response_model=list[TenantOut], responses=ERRORS, summary="List tenants")
def list_tenants(session: SessionDep, _: TenantsRead) -> list[TenantOut]:
    """Configured tenants and every tenant with waiting or running jobs, with GPUs in use."""
    return tenants.list_tenants(session)


@router.put("/{name}", response_model=TenantOut, responses=ERRORS,
            summary="Set a tenant's weight, quota and priority cap")
def put_tenant(name: TenantName, body: TenantIn, session: SessionDep, _: TenantsManage,
               runtime: RuntimeDep) -> TenantOut:
    """Create or replace. A lower quota stops nothing: the tenant's next jobs wait until it is under."""
    tenants.put_tenant(session, name, body)
    runtime.wake_scheduler()  # a higher weight or quota may admit jobs now
    return tenants.tenant_out(session, name)
