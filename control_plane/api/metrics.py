"""GET /metrics: Prometheus text format (services/read/metrics.py; docs/operations.md, "Metrics")."""

from __future__ import annotations

from fastapi import APIRouter, Response

from control_plane.api.deps import MetricsAccess, RuntimeDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {"text/plain": {}}}, 401: {"description": "A metrics token is set"}})
def metrics(_: MetricsAccess, runtime: RuntimeDep) -> Response:
    body, content_type = runtime.metrics.render()
    return Response(content=body, media_type=content_type)
