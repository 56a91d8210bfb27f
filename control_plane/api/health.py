"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.deps import PUBLIC, RuntimeDep, TransactionRoute
from control_plane.db import code_schema_version, schema_problem
from control_plane.errors import NotReady

router = APIRouter(tags=["health"], route_class=TransactionRoute, dependencies=[PUBLIC])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The database is reachable and migrated")
def readyz(runtime: RuntimeDep) -> dict[str, str]:
    try:
        problem = schema_problem(runtime.engine)
    except Exception as exc:
        raise NotReady(f"database not ready: {type(exc).__name__}") from exc
    if problem is not None:
        raise NotReady(problem)
    return {"status": "ready", "schema": code_schema_version()}
