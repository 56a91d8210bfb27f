"""/v1/plans: the layout planner (docs/planner.md), a thin route over services.read.plans."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.deps import PlansCreate, SessionDep, SettingsDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.plans import PlanOut, PlanRequest
from control_plane.services.read import plans

router = APIRouter(prefix="/v1/plans", tags=["plans"], route_class=TransactionRoute)


@router.post("", response_model=PlanOut, responses=ERRORS, summary="Plan a model's parallel layout")
def make_plan(body: PlanRequest, session: SessionDep, settings: SettingsDep, _: PlansCreate) -> PlanOut:
    """Memory per GPU, bytes per link class, step time and tokens/s of each layout on each GPU count,
    and a recommendation with its reason. Nothing is stored. When the cluster has nodes of
    `gpu_kind`, their labels (`trainyard.dev/inter-link`, ...) set the link figures. 422 with the
    numbers when nothing fits or the inputs contradict each other."""
    return plans.make_plan(session, body, min_efficiency=settings.plan_min_efficiency)
