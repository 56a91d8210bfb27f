"""The FastAPI application: routers, problem+json errors, background loops."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane.api import agent, health, jobs, nodes
from control_plane.db import make_engine, make_session_factory
from control_plane.errors import PROBLEM_JSON, TrainyardError, Unauthorized
from control_plane.logging import configure_logging
from control_plane.scheduler.loops import Loops
from control_plane.settings import Settings

API_DESCRIPTION = """
Trainyard runs multi-node `torchrun` training jobs: it gang-allocates every GPU a job needs in one
transaction, starts the workers through node agents, and reports progress, logs and results.

Authenticate with `Authorization: Bearer <admin token>`. Errors are RFC 9457
`application/problem+json` documents.
"""


def _problem(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TrainyardError)
    async def _domain(request: Request, exc: TrainyardError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        return _problem(exc.status, exc.problem(request.url.path), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "field": ".".join(str(p) for p in e.get("loc", ()) if p not in ("body",)),
                "message": e.get("msg", ""),
                "type": e.get("type", ""),
            }
            for e in exc.errors()
        ]
        detail = "; ".join(f"{e['field'] or 'body'}: {e['message']}" for e in errors)
        return _problem(422, {
            "type": "https://trainyard.dev/problems/validation",
            "title": "The request is invalid",
            "status": 422,
            "detail": detail,
            "instance": request.url.path,
            "errors": errors,
        })

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _problem(exc.status_code, {
            "type": "about:blank",
            "title": str(exc.detail),
            "status": exc.status_code,
            "detail": str(exc.detail),
            "instance": request.url.path,
        })


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(json=settings.log_json, level=settings.log_level)
    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)
    loops = Loops(factory, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.run_loops:
            loops.start()
        try:
            yield
        finally:
            loops.stop()
            engine.dispose()

    app = FastAPI(
        title="Trainyard",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = factory
    app.state.loops = loops
    app.state.wake_scheduler = loops.wake_scheduler
    _install_error_handlers(app)
    for module in (health, jobs, nodes, agent):
        app.include_router(module.router)
    return app
