"""Liveness and readiness."""

from __future__ import annotations

from fastapi import APIRouter

from control_plane.api.deps import PUBLIC, RuntimeDep, TransactionRoute
from control_plane.db import schema_version
from control_plane.errors import NotReady

router = APIRouter(tags=["health"], route_class=TransactionRoute, dependencies=[PUBLIC])


@router.get("/healthz", summary="The process is up")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="The database is reachable and migrated")
def readyz(runtime: RuntimeDep) -> dict[str, str]:
    try:
        version = schema_version(runtime.engine)
    except Exception as exc:
        raise NotReady(f"database not ready: {type(exc).__name__}") from exc
    if not version:
        raise NotReady("database schema is not migrated; run 'trainyard migrate'")
    return {"status": "ready", "schema": str(version)}
