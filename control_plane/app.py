"""The FastAPI application: routers, problem+json errors, background loops."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
import structlog
import urllib3
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from control_plane import clock, openapi
from control_plane.api import (
    agent,
    code,
    docs,
    health,
    jobs,
    join_tokens,
    metrics,
    nodes,
    plans,
    principals,
    simulations,
    tenants,
    ui,
    uploads,
)
from control_plane.api.deps import api_routes, route_policy
from control_plane.db import make_engine, make_session_factory
from control_plane.errors import PROBLEM_JSON, TooMany, TrainyardError, Unauthorized
from control_plane.http_deadlines import BodyIdleTimeout
from control_plane.lanes import LaneMiddleware, Lanes
from control_plane.limits_http import BodyLimit
from control_plane.logging import configure_logging
from control_plane.scheduler.loops import Loops
from control_plane.services.checkpoints import upload_slots
from control_plane.services.read import goodput
from control_plane.services.read.metrics import Exporter
from control_plane.services.runs.code_upload import UploadGate
from control_plane.services.runs.logs import Followers
from control_plane.settings import Settings
from control_plane.wakeups import SLOT_CHANNEL, Busy, Wakeups
from trainyard.protocol.s3tls import read_ca_pem, tls_failure
from trainyard.storage.s3 import S3Config, S3Storage

log = structlog.get_logger("trainyard.app")

API_DESCRIPTION = """
Trainyard runs multi-node `torchrun` training jobs: it gang-allocates every GPU a job needs in one
transaction, starts the workers through node agents, and reports progress, logs and results.

Authenticate with `Authorization: Bearer <token>`: a principal's API token (`tyt_...`; roles admin,
operator, member, viewer: see each operation's `x-trainyard-policy`), or the bootstrap admin token.
Errors are RFC 9457 `application/problem+json` documents.
"""


def _problem(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, media_type=PROBLEM_JSON, headers=headers)


RETRY_AFTER_S = 1
"""What a 503 for a busy database (pool exhausted, lock conflict) tells the client to wait."""

# SQLSTATEs of a transaction that lost a race and may simply be run again: serialization_failure,
# deadlock_detected, lock_not_available.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03"})
# SQLSTATE classes of a database that cannot serve anyone now but may soon: connection exception
# (08), insufficient resources (53: too many connections, out of memory or disk), operator
# intervention (57: shutdown, crash recovery, a cancelled statement).
RETRYABLE_CLASSES = ("08", "53", "57")


def _sqlstate(exc: DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None)


def retryable(exc: DBAPIError) -> bool:
    """Whether a database error is an outage or a lost race (503, retry) rather than a bug (500).

    A server that cannot be reached at all (connection refused or reset, a timeout, a socket that
    vanished) answers with no SQLSTATE: the driver raises OperationalError or InterfaceError (PEP
    249: errors of the database's operation, not of the statement) without one."""
    state = _sqlstate(exc)
    if exc.connection_invalidated:
        return True
    if state is None:
        return isinstance(exc, (OperationalError, InterfaceError))
    return state in RETRYABLE_SQLSTATES or state[:2] in RETRYABLE_CLASSES


def _busy(request: Request, detail: str) -> JSONResponse:
    return _problem(503, {
        "type": "https://trainyard.dev/problems/unavailable",
        "title": "The control plane is busy; retry",
        "status": 503,
        "detail": detail,
        "instance": request.url.path,
    }, {"Retry-After": str(RETRY_AFTER_S)})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(PoolTimeout)
    async def _pool_timeout(request: Request, exc: PoolTimeout) -> JSONResponse:
        log.warning("database connection pool exhausted", path=request.url.path)
        return _busy(request, "no database connection became free in time")

    @app.exception_handler(Busy)
    async def _too_many_waits(request: Request, exc: Busy) -> JSONResponse:
        return _busy(request, f"{exc}; retry the long poll later")

    @app.exception_handler(DBAPIError)
    async def _database(request: Request, exc: DBAPIError) -> JSONResponse:
        state = _sqlstate(exc)
        if retryable(exc):
            log.warning("transient database error", path=request.url.path, sqlstate=state,
                        error=type(exc.orig).__name__)
            if state is None:
                return _busy(request, "the database cannot be reached for now")
            return _busy(request, f"the database refused this transaction for now (SQLSTATE {state})")
        raise exc

    @app.exception_handler(urllib3.exceptions.HTTPError)
    async def _object_store(request: Request, exc: urllib3.exceptions.HTTPError) -> JSONResponse:
        # S3 unreachable or not trusted (the MinIO SDK lets urllib3's errors through): the store's
        # trouble, said in one line, never a 500.
        settings = request.app.state.settings
        where = f"{'https' if settings.s3_secure else 'http'}://{settings.s3_endpoint}"
        detail = tls_failure(exc, where) or f"S3 at {where} cannot be reached: {type(exc).__name__}"
        log.warning("object store unavailable", path=request.url.path, detail=detail)
        return _problem(503, {
            "type": "https://trainyard.dev/problems/storage-unavailable",
            "title": "Checkpoint storage is unavailable",
            "status": 503,
            "detail": detail,
            "instance": request.url.path,
        }, {"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(TrainyardError)
    async def _domain(request: Request, exc: TrainyardError) -> Response:
        if request.url.path.startswith("/ui") and "text/html" in request.headers.get("accept", ""):
            return ui.error_page(request, exc.status, exc.detail)  # a browser: a page, or the login
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else None
        if isinstance(exc, TooMany):
            headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
        return _problem(exc.status, exc.problem(request.url.path), headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_field_error(e, exc.body) for e in exc.errors()]
        detail = "; ".join(f"{e['field'] or 'body'}: {e['message']}" for e in errors)
        return _problem(422, {
            "type": "https://trainyard.dev/problems/validation",
            "title": "The request is invalid",
            "status": 422,
            "detail": detail,
            "instance": request.url.path,
            "errors": errors,
        })

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not a refusal: logged at error level with its traceback (a 500 must never pass
        # as routine), answered as problem+json.
        log.error("unhandled error", path=request.url.path, method=request.method, exc_info=exc)
        return _problem(500, {
            "type": "about:blank",
            "title": "Internal error",
            "status": 500,
            "detail": f"{type(exc).__name__}: the control plane failed to handle this request (see its log)",
            "instance": request.url.path,
        })

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, UnicodeDecodeError):
            # A body that is not UTF-8 is not JSON either: the 422 any other such body gets (FastAPI
            # raises a bare 400 for it, which the document does not declare).
            return _not_utf8(request, exc.__cause__)
        return _problem(exc.status_code, {
            "type": "about:blank",
            "title": str(exc.detail),
            "status": exc.status_code,
            "detail": str(exc.detail),
            "instance": request.url.path,
        })


def _not_utf8(request: Request, error: UnicodeDecodeError) -> JSONResponse:
    message = f"the body is not valid JSON: not UTF-8 (byte 0x{error.object[error.start]:02x} at offset {error.start})"
    return _problem(422, {
        "type": "https://trainyard.dev/problems/validation",
        "title": "The request is invalid",
        "status": 422,
        "detail": message,
        "instance": request.url.path,
        "errors": [{"field": "", "message": message, "type": "json_invalid"}],
    })


def _field_error(error: Any, body: Any) -> dict[str, Any]:
    """One entry of a 422's ``errors``. A body that is not JSON says where it breaks, as line and
    column (FastAPI gives a character offset), and never names the offset as a field."""
    if error.get("type") == "json_invalid":
        loc = tuple(error.get("loc", ()))
        pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else 0
        text = body if isinstance(body, str) else ""
        line = text.count("\n", 0, pos) + 1
        column = pos - (text.rfind("\n", 0, pos) + 1) + 1
        why = (error.get("ctx") or {}).get("error") or "invalid JSON"
        return {"field": "", "message": f"the body is not valid JSON: {why} at line {line} column {column}",
                "type": "json_invalid", "line": line, "column": column}
    return {
        "field": ".".join(str(p) for p in error.get("loc", ()) if p not in ("body",)),
        "message": error.get("msg", ""),
        "type": error.get("type", ""),
    }


def object_store(settings: Settings):  # type: ignore[no-untyped-def]
    """The control plane's S3 access (verify shards, write manifests, delete old checkpoints, sign
    workers' URLs): the only holder of the credentials."""
    if not settings.s3_endpoint:
        return None

    config = S3Config(endpoint=settings.s3_endpoint, bucket=settings.s3_bucket, access_key=settings.s3_access_key,
                      secret_key=settings.s3_secret_key, secure=settings.s3_secure, region=settings.s3_region,
                      public_endpoint=settings.s3_worker_endpoint, ca_file=settings.s3_ca_file)
    return S3Storage(config, timeout_s=10.0, retries=1)


def worker_storage(settings: Settings) -> dict[str, Any]:
    """What agents and workers learn about checkpoint storage: that there is some, reached through
    presigned URLs the control plane grants per object (trainyard/protocol/grants.py). No endpoint,
    no credential."""
    if not settings.s3_endpoint:
        return {}
    if settings.s3_ca_file:  # public, and small (s3tls.MAX_CA_PEM_BYTES): workers verify S3 with it

        return {"access": "presigned", "ca_pem": read_ca_pem(settings.s3_ca_file)}
    return {"access": "presigned"}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    configure_logging(json=settings.log_json, level=settings.log_level)
    # Every request thread, long-poll answer thread (agent_wait_threads), loop thread and the
    # upload-slot pass runner may hold one connection at once (never two, and none while waiting for
    # a thread: api/deps.py), so the pool with its overflow covers them all and a request never waits
    # for a connection held by a request that waits for a thread. The answer threads are in the
    # overflow, not in what the pool keeps open: two replicas keep at most 2 x 47 (plus their
    # listeners) of the embedded PostgreSQL's 100 connections between bursts, as before them.
    engine = make_engine(settings.database_url, pool_size=settings.api_threads + Loops.THREADS + 1,
                         max_overflow=10 + settings.agent_wait_threads, pool_timeout_s=settings.pool_timeout_s)
    factory = make_session_factory(engine)
    store = object_store(settings)
    # Bookkeeping never takes every request thread: liveness keeps at least one (settings check it).
    lanes = Lanes(bookkeeping_concurrency=max(1, min(settings.bookkeeping_concurrency, settings.api_threads - 1)),
                  queue_max=settings.bookkeeping_queue_max, wait_s=settings.bookkeeping_wait_s,
                  gated=settings.bookkeeping_gate)
    loops = Loops(factory, settings, store, liveness_wait=lanes.oldest_liveness_s)
    wakeups = Wakeups(settings.database_url, max_waiters=settings.agent_wait_max, threads=settings.agent_wait_threads)
    wakeups.install(factory)
    slot_wakeups = Wakeups(settings.database_url, max_waiters=settings.upload_slot_wait_max, channel=SLOT_CHANNEL)
    slot_wakeups.install(factory)
    slot_passes = upload_slots.PassRunner(factory, settings, held=slot_wakeups.keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # What is alive once the app has started (modules, metadata, the app) lives as long as the
        # process: keep it out of the garbage collector's full collections, which otherwise walk it
        # in the middle of scheduling passes (tens of ms each at 10^4 waiting jobs).
        gc.freeze()
        anyio.to_thread.current_default_thread_limiter().total_tokens = settings.api_threads
        try:
            skew = clock.anchor(engine)
            if abs(skew.total_seconds()) > 1:
                log.warning("wall clock differs from the database clock; decisions use the database's",
                            skew_s=round(skew.total_seconds(), 3))
        except Exception:
            log.warning("database clock not readable at start; anchoring on the first loop", exc_info=True)
        await wakeups.start()
        await slot_wakeups.start()
        slot_passes.start()
        if settings.run_loops:
            loops.start()
        try:
            yield
        finally:
            await wakeups.stop()
            await slot_wakeups.stop()
            slot_passes.stop()
            loops.stop()
            engine.dispose()

    app = FastAPI(
        title="Trainyard",
        version="0.1.0",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,  # served by api/docs.py with local assets
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.session_factory = factory
    app.state.loops = loops
    app.state.wakeups = wakeups
    app.state.slot_wakeups = slot_wakeups
    app.state.slot_passes = slot_passes
    app.state.wake_scheduler = loops.wake_scheduler
    app.state.object_store = store
    app.state.worker_storage = worker_storage(settings)
    app.state.lanes = lanes
    app.state.metrics = Exporter(factory, settings.metrics_cache_s, goodput.for_cluster, lanes.figures)
    app.state.log_followers = Followers(settings.log_followers_per_principal)
    app.state.code_uploads = UploadGate(settings.code_uploads_per_principal)
    _install_error_handlers(app)
    for module in (health, jobs, code, nodes, tenants, plans, simulations, principals, join_tokens, uploads, agent,
                   metrics, docs, ui):
        app.include_router(module.router)
    _document_policies(app)
    openapi.install(app, API_DESCRIPTION)
    app.mount(docs.SWAGGER, StaticFiles(directory=swagger_ui_path()), name="swagger-ui")
    app.mount(docs.VENDOR, StaticFiles(directory=openapi.STATIC_DIR), name="vendor")
    # Innermost: a request is put in its lane after the body checks, and right before its route.
    app.add_middleware(LaneMiddleware, lanes=lanes)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes,
                       larger={"/v1/code/": settings.max_code_bytes})
    # Outside BodyLimit (added last), so that a chunked body BodyLimit reads is timed too.
    app.add_middleware(BodyIdleTimeout, idle_s=settings.request_body_idle_s)
    return app


def swagger_ui_path() -> str:
    import swagger_ui_bundle

    return str(swagger_ui_bundle.swagger_ui_path)


def _document_policies(app: FastAPI) -> None:
    """Each operation's policy and roles in the OpenAPI document (x-trainyard-policy)."""
    for route in api_routes(app.routes):
        if (policy := route_policy(route)) is not None:
            route.openapi_extra = {**(route.openapi_extra or {}), "x-trainyard-policy": {
                "name": policy.name, "credential": policy.credential, "roles": sorted(policy.roles),
                "tenant_scoped": policy.tenant_scoped}}
