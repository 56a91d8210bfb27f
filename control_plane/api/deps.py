"""Dependencies shared by the routers: the session, the principal, the node identity, and the
runtime collaborators (``RuntimeDep``). This module is the only one under api/ that reads
``request.app.state`` or ends a transaction itself (tests/control_plane/test_routes_are_thin.py)."""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane import authz
from control_plane.authz import Principal
from control_plane.errors import Forbidden, Unauthorized
from control_plane.lanes import ARRIVED_AT
from control_plane.services.access import principals, ui_sessions
from control_plane.services.cluster import nodes
from control_plane.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="API token of a principal (tyt_...), the bootstrap admin token, "
                     "a node credential (agents, tyn_...) or a join token (registration, tyj_...).")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


@dataclass(frozen=True)
class Runtime:
    """What routes need besides the session, read once per request from the app: scheduler
    wake-ups (``services.cluster.agent_protocol.Wakeups``), checkpoint storage, and the session factory
    and engine for work that outlives the request's transaction (log follow, readiness)."""

    loops: Any
    """scheduler.loops.Loops (``wake_scheduler``, ``schedule_once``)."""
    run_loops: bool
    object_store: Any
    """The control plane's S3 access, or None without S3 (app.object_store)."""
    worker_storage: dict[str, Any]
    """What workers get to reach checkpoint storage (app.worker_storage)."""
    session_factory: sessionmaker[Session]
    engine: Engine
    wakeups: Any = None
    """control_plane.wakeups.NodeWakeups: the agents' long polls (app.wakeups)."""
    slot_wakeups: Any = None
    """control_plane.wakeups.Wakeups: the long polls for checkpoint upload slots (app.slot_wakeups)."""
    slot_passes: Any = None
    """services.checkpoints.upload_slots.PassRunner: this replica's upload-slot grant passes (app.slot_passes)."""
    metrics: Any = None
    """services.read.metrics.Exporter: what GET /metrics answers (app.metrics)."""
    log_followers: Any = None
    """services.runs.logs.Followers: followed logs per principal on this replica (app.log_followers)."""
    code_uploads: Any = None
    """services.runs.code_upload.UploadGate: code uploads in flight per principal on this replica."""
    lanes: Any = None
    """control_plane.lanes.Lanes: this replica's liveness lane and bookkeeping gate (app.lanes)."""

    def wake_scheduler(self) -> None:
        self.loops.wake_scheduler()

    def schedule_now(self) -> bool:
        """A scheduling pass in this thread (its own transaction); False where loops do not run here."""
        return bool(self.run_loops and self.loops.schedule_once())


def get_runtime(request: Request) -> Runtime:
    state = request.app.state
    return Runtime(loops=state.loops, run_loops=state.settings.run_loops, object_store=state.object_store,
                   worker_storage=dict(state.worker_storage or {}), session_factory=state.session_factory,
                   engine=state.engine, wakeups=getattr(state, "wakeups", None),
                   slot_wakeups=getattr(state, "slot_wakeups", None), slot_passes=getattr(state, "slot_passes", None),
                   metrics=getattr(state, "metrics", None), log_followers=getattr(state, "log_followers", None),
                   code_uploads=getattr(state, "code_uploads", None), lanes=getattr(state, "lanes", None))


async def get_session(request: Request) -> AsyncIterator[Session]:
    """The request's session. Async: making a session touches no database, and the endpoint ends its
    transaction in its own thread (TransactionRoute), so closing it here does no I/O either; a sync
    generator cost every request two more thread hand-offs (its start and its end, bench/request_cost.py)."""
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


# A database connection is held only by a thread that is running (docs/architecture.md, "Threads
# and connections"). FastAPI runs each sync dependency and the endpoint in separate threadpool
# threads, and serializes the response in yet another: a transaction still open when one of them
# returns would hold its connection while the request waits for the next thread, and a burst of
# requests would then hold every connection while every thread waits for one (finding 20). So
# every dependency and every endpoint ends the transaction it opened before its thread returns.


def end_transaction(session: Session, *, ok: bool) -> None:
    """End the session's transaction, releasing its connection. A read-only transaction commits
    (the loaded objects stay usable, ``expire_on_commit=False``); one that wrote without its
    service committing is rolled back, as the request's end would have."""
    if not session.in_transaction():
        return
    if ok and not session.info.get("wrote") and not (session.new or session.dirty or session.deleted):
        session.commit()
    else:
        session.rollback()


def _ends_transactions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)
    def call(*args: Any, **kwargs: Any) -> Any:
        sessions = [v for v in (*args, *kwargs.values()) if isinstance(v, Session)]
        try:
            result = endpoint(*args, **kwargs)
        except BaseException:
            for session in sessions:
                end_transaction(session, ok=False)
            raise
        for session in sessions:
            end_transaction(session, ok=True)
        return result

    return call


class TransactionRoute(APIRoute):
    """A route whose sync endpoint ends its session's transaction in its own thread."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint):
            endpoint = _ends_transactions(endpoint)
        super().__init__(path, endpoint, **kwargs)


def get_agent_openapi(request: Request) -> dict[str, Any]:
    """The agents' OpenAPI document (control_plane/openapi.py)."""
    document: dict[str, Any] = request.app.state.agent_openapi()
    return document


async def get_arrived_at(request: Request) -> datetime | None:
    """When a liveness request reached this replica, before any queue (control_plane/lanes.py).
    Async: it needs no thread."""
    arrived: datetime | None = request.scope.get(ARRIVED_AT)
    return arrived


SettingsDep = Annotated[Settings, Depends(get_settings)]
ArrivedAt = Annotated[datetime | None, Depends(get_arrived_at)]
AgentOpenApi = Annotated[dict[str, Any], Depends(get_agent_openapi)]
SessionDep = Annotated[Session, Depends(get_session)]
RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# -- Who is calling: every route declares one policy (control_plane/authz.py) -----------------------
#
# A route's policy is the ``policy`` attribute of one of its dependencies (``route_policy``):
# ``Allow`` for principals' tokens, ``NodeCredential`` for node credentials, ``RegisterGuard`` for
# registration, ``PUBLIC`` for health checks. tests/control_plane/test_authz_matrix.py fails for a
# route without one and calls every route as every role.


def _token(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or not creds.credentials:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return creds.credentials


def authenticate_token(token: str, settings: Settings, session: Session) -> Principal | None:
    """The principal of a token: the bootstrap admin token, or a principal's valid API token."""
    if settings.admin_token and authz.same_secret(token, settings.admin_token):
        return Principal(name=authz.BOOTSTRAP_ADMIN, tenant=settings.admin_tenant, role=authz.Role.admin)
    try:
        principal = principals.authenticate(session, token)
    except BaseException:
        end_transaction(session, ok=False)
        raise
    session.commit()  # before the endpoint's thread (see end_transaction): last_used_at
    return principal


class Allow:
    """Authenticate a principal's token and require a role the policy allows (403 otherwise)."""

    def __init__(self, name: str) -> None:
        self.policy = authz.policy(name)
        assert self.policy.credential == "user", name

    def __call__(self, creds: Credentials, settings: SettingsDep, session: SessionDep) -> Principal:
        principal = authenticate_token(_token(creds), settings, session)
        if principal is None:
            raise Unauthorized("invalid, expired or revoked bearer token")
        if not self.policy.allows(principal.role):
            raise Forbidden(f"a {principal.role} may not do this ({self.policy.name}: "
                            f"{', '.join(sorted(self.policy.roles))})")
        return principal


UI_COOKIE = "trainyard_session"
"""The dashboard's session cookie: a session's own secret (services/access/ui_sessions.py), never an API
token (HttpOnly, SameSite=Strict)."""
LOGIN_COOKIE = "trainyard_login"
"""A random value the login form is tied to (login CSRF: another site cannot log a browser in)."""
CSRF_HEADER = "X-CSRF-Token"


def csrf_token(token: str) -> str:
    """What a page sends back with a state-changing request made with the session cookie: derived
    from the token, which a page of another site cannot read (HttpOnly), so it cannot forge it."""
    return hashlib.sha256(b"trainyard-csrf:" + token.encode("utf-8", "surrogatepass")).hexdigest()[:32]


class UiAllow(Allow):
    """``Allow`` for the dashboard (api/ui.py): the token from the session cookie, or the
    Authorization header. A POST made with the cookie must carry ``csrf_token`` of it (header
    X-CSRF-Token or form field ``csrf``), so that no other site can make the browser cancel a job;
    SameSite=Strict already keeps the cookie off cross-site requests."""

    def __call__(self, request: Request, creds: Credentials, settings: SettingsDep,  # type: ignore[override]
                 session: SessionDep) -> Principal:
        cookie = request.cookies.get(UI_COOKIE)
        via_cookie = (creds is None or not creds.credentials) and bool(cookie)
        if not via_cookie:
            return super().__call__(creds, settings, session)
        try:
            principal = ui_sessions.authenticate(session, str(cookie), admin_token=settings.admin_token,
                                                 admin_tenant=settings.admin_tenant)
        except BaseException:
            end_transaction(session, ok=False)
            raise
        session.commit()  # before the endpoint's thread (see end_transaction)
        if principal is None:
            raise Unauthorized("the dashboard session has ended (logged out, expired or its token revoked)")
        if not self.policy.allows(principal.role):
            raise Forbidden(f"a {principal.role} may not do this ({self.policy.name}: "
                            f"{', '.join(sorted(self.policy.roles))})")
        if request.method not in ("GET", "HEAD"):
            sent = request.headers.get(CSRF_HEADER, "")
            if not authz.same_secret(sent, csrf_token(str(cookie))):
                raise Forbidden("missing or wrong CSRF token: reload the page and try again")
        return principal


class NodeCredential:
    """A node credential, checked here only for its form (no database): the agent route authenticates
    it as the first statement of its own transaction (api/agent.py), and a long poll's service checks
    it. A token that cannot be a node's (a principal's, a join token) is 401 here, before the body
    is read."""

    policy = authz.policy("agent")

    async def __call__(self, creds: Credentials) -> str:
        token = _token(creds)
        if nodes.node_id_of(token) is None:
            raise Unauthorized("not a node credential: register the agent for one")
        return token


class RegisterGuard:
    """The credential a registration presents: checked by the service, in the registration's own
    transaction (a join token's use commits with the node it registered)."""

    policy = authz.policy("agent.register")

    def __call__(self, creds: Credentials) -> str:
        return _token(creds)


class MetricsGuard:
    """GET /metrics: open when no metrics token is set (it shows no job names, ids or tenants), else
    that token or the admin token (docs/operations.md, "Metrics")."""

    policy = authz.policy("metrics.read")

    def __call__(self, creds: Credentials, settings: SettingsDep) -> None:
        if not settings.metrics_token:
            return
        token = _token(creds)
        if not any(t and authz.same_secret(token, t) for t in (settings.metrics_token, settings.admin_token)):
            raise Unauthorized("invalid bearer token for /metrics")


class Declared:
    """A route open to everyone, said so (its ``policy``)."""

    def __init__(self, name: str) -> None:
        self.policy = authz.policy(name)

    def __call__(self) -> None:
        return None


PUBLIC = Depends(Declared("public"))


def api_routes(routes: Iterable[Any]) -> Iterator[APIRoute]:
    """Every APIRoute of an app's route table, also those of included routers (which FastAPI keeps
    as included-router entries, each with its ``original_router``)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)


def other_routes(routes: Iterable[Any]) -> Iterator[Any]:
    """The routes that are neither API routes nor included routers (FastAPI's documentation pages)."""
    for route in routes:
        if not isinstance(route, APIRoute) and getattr(route, "original_router", None) is None:
            yield route


def route_policy(route: APIRoute) -> authz.Policy | None:
    """The policy a route declares through its dependencies; None if it declares none."""
    found: list[authz.Policy] = []

    def walk(dependant: Any) -> None:
        declared = getattr(dependant.call, "policy", None)
        if isinstance(declared, authz.Policy):
            found.append(declared)
        for sub in dependant.dependencies:
            walk(sub)

    walk(route.dependant)
    if len({p.name for p in found}) > 1:
        raise RuntimeError(f"route {route.path} declares several policies: {sorted({p.name for p in found})}")
    return found[0] if found else None


def _allowed(name: str) -> Any:
    return Annotated[Principal, Depends(Allow(name))]


def _ui(name: str) -> Any:
    return Annotated[Principal, Depends(UiAllow(name))]


SelfDep = _allowed("self")
JobsRead = _allowed("jobs.read")
JobsSubmit = _allowed("jobs.submit")
JobsCancel = _allowed("jobs.cancel")
ClusterRead = _allowed("cluster.read")
PlansCreate = _allowed("plans.create")
SimulationsCreate = _allowed("simulations.create")
MetricsAccess = Annotated[None, Depends(MetricsGuard())]
CodeUpload = _allowed("code.upload")
NodesRead = _allowed("nodes.read")
NodesManage = _allowed("nodes.manage")
JoinTokensManage = _allowed("join_tokens.manage")
TenantsRead = _allowed("tenants.read")
TenantsManage = _allowed("tenants.manage")
PrincipalsManage = _allowed("principals.manage")
UiJobsRead = _ui("jobs.read")
UiJobsCancel = _ui("jobs.cancel")
UiClusterRead = _ui("cluster.read")
UiNodesRead = _ui("nodes.read")
NodeToken = Annotated[str, Depends(NodeCredential())]
RegisterCredential = Annotated[str, Depends(RegisterGuard())]


def _legacy_admin(creds: Credentials, settings: SettingsDep, session: SessionDep) -> Principal:
    return Allow("principals.manage")(creds, settings, session)


PrincipalDep = Annotated[Principal, Depends(_legacy_admin)]
"""Admins only, and no declared policy: a route still using it (written before roles) is safe, and
fails the authorization matrix test until it declares its policy."""
