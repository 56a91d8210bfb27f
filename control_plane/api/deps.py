"""Dependencies shared by the routers: the session, the principal, the node identity, and the
runtime collaborators (``RuntimeDep``). This module is the only one under api/ that reads
``request.app.state`` or ends a transaction itself (tests/control_plane/test_routes_are_thin.py)."""

from __future__ import annotations

import functools
import hmac
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane.errors import Unauthorized
from control_plane.models import Node
from control_plane.services import nodes
from control_plane.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="Admin token (API) or node credential (agents).")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


@dataclass(frozen=True)
class Runtime:
    """What routes need besides the session, read once per request from the app: scheduler
    wake-ups (``services.agent_protocol.Wakeups``), checkpoint storage, and the session factory
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
    """control_plane.wakeups.Wakeups: the agents' long polls (app.wakeups)."""
    slot_wakeups: Any = None
    """control_plane.wakeups.Wakeups: the long polls for checkpoint upload slots (app.slot_wakeups)."""

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
                   slot_wakeups=getattr(state, "slot_wakeups", None))


def get_session(request: Request) -> Iterator[Session]:
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


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


@dataclass(frozen=True)
class Principal:
    """Who is calling. Today only the admin; tenants and roles hang off this later."""

    name: str
    is_admin: bool


def _token(creds: HTTPAuthorizationCredentials | None) -> str:
    if creds is None or not creds.credentials:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return creds.credentials


def get_principal(creds: Credentials, settings: SettingsDep) -> Principal:
    token = _token(creds)
    if settings.admin_token and hmac.compare_digest(token.encode(), settings.admin_token.encode()):
        return Principal(name="admin", is_admin=True)
    raise Unauthorized("invalid bearer token")


def get_join(creds: Credentials, settings: SettingsDep) -> None:
    token = _token(creds)
    if not settings.join_token or not hmac.compare_digest(token.encode(), settings.join_token.encode()):
        raise Unauthorized("invalid join token")


def get_node(creds: Credentials, session: SessionDep) -> Node:
    try:
        node = nodes.authenticate(session, _token(creds))
    except BaseException:
        end_transaction(session, ok=False)
        raise
    # The endpoint runs in another thread: end the transaction (and release its connection) before
    # waiting for it. It commits, as the endpoint's commit would have, whatever authenticating wrote.
    session.commit()
    return node


PrincipalDep = Annotated[Principal, Depends(get_principal)]
NodeIdentity = Annotated[Node, Depends(get_node)]
JoinDep = Annotated[None, Depends(get_join)]
