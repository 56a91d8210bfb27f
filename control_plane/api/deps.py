"""Dependencies shared by the routers: the session, the principal, the node identity."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from control_plane.errors import Unauthorized
from control_plane.models import Node
from control_plane.services import nodes
from control_plane.settings import Settings

_bearer = HTTPBearer(auto_error=False, description="Admin token (API) or node credential (agents).")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_session(request: Request) -> Iterator[Session]:
    session = request.app.state.session_factory()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
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
    return nodes.authenticate(session, _token(creds))


PrincipalDep = Annotated[Principal, Depends(get_principal)]
NodeIdentity = Annotated[Node, Depends(get_node)]
JoinDep = Annotated[None, Depends(get_join)]
