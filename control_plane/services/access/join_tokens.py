"""Join tokens: how an agent proves it may register a node (docs/security.md, "Node identity").

A join token expires, and is single-use unless created with more uses. Without a node name it
registers new node names only (and nodes an operator removed); one bound to a node name may also
re-claim that registered node, for an agent that lost its credential: the operator who made it
vouches for the machine. A registered node is otherwise re-registered only with its own current
credential, which the agent keeps in its work dir. The static TRAINYARD_JOIN_TOKEN, when set,
works as an unbound token that never expires: for automation, never needed.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.authz import JOIN_TOKEN_PREFIX, Principal, hash_token, new_token, same_secret
from control_plane.clock import now
from control_plane.errors import NodeNameTaken, NotFound, Unauthorized
from control_plane.models import JoinToken, Node
from control_plane.schemas.principals import JoinTokenIn, JoinTokenOut


def create(session: Session, body: JoinTokenIn, *, by: Principal) -> tuple[JoinTokenOut, str]:
    token = new_token(JOIN_TOKEN_PREFIX)
    t = now()
    row = JoinToken(id=uuid.uuid4(), token_hash=hash_token(token), node_name=body.node_name, max_uses=body.max_uses,
                    uses=0, description=body.description, created_by=by.name, created_at=t,
                    expires_at=t + timedelta(seconds=body.ttl_s))
    session.add(row)
    session.commit()
    return out(row), token


def usable(row: JoinToken) -> bool:
    return (row.revoked_at is None and row.expires_at > now()
            and (row.max_uses is None or row.uses < row.max_uses))


def out(row: JoinToken) -> JoinTokenOut:
    return JoinTokenOut(id=str(row.id), node_name=row.node_name, max_uses=row.max_uses, uses=row.uses,
                        description=row.description, created_by=row.created_by, created_at=row.created_at,
                        expires_at=row.expires_at, last_used_at=row.last_used_at, revoked_at=row.revoked_at,
                        usable=usable(row))


def list_tokens(session: Session) -> list[JoinTokenOut]:
    return [out(r) for r in session.scalars(select(JoinToken).order_by(JoinToken.created_at, JoinToken.id))]


def revoke(session: Session, token_id: uuid.UUID) -> JoinTokenOut:
    row = session.get(JoinToken, token_id, with_for_update=True)
    if row is None:
        raise NotFound(f"join token {token_id} does not exist")
    if row.revoked_at is None:
        row.revoked_at = now()
    session.commit()
    return out(row)


def authorize_registration(session: Session, token: str, name: str, node: Node | None, *,
                           static_token: str = "") -> None:
    """May ``token`` (a join token) register node ``name`` (``node``: its row, locked, if any)?
    Consumes one use of a join token, in the caller's transaction: the registration and the use
    commit together. Raises Unauthorized or NodeNameTaken."""
    bound: str | None = None
    row: JoinToken | None = None
    if token.startswith(JOIN_TOKEN_PREFIX):
        row = session.scalar(select(JoinToken).where(JoinToken.token_hash == hash_token(token)).with_for_update())
        if row is None or not usable(row):
            raise Unauthorized("unknown, expired, revoked or used-up join token; ask an operator for a new one "
                               "(trainyard join-tokens create)")
        bound = row.node_name
        if bound is not None and bound != name:
            raise Unauthorized(f"this join token is for node {bound!r}, not {name!r}")
    elif not (static_token and same_secret(token, static_token)):
        raise Unauthorized("invalid join token")
    if node is not None and node.state != "removed" and bound != name:
        raise NodeNameTaken(
            f"node {name!r} is registered ({node.state}): its agent registers again with its own credential (kept "
            f"in its work dir); an agent that lost it needs a join token an operator made for {name!r} "
            "(trainyard join-tokens create --node NAME)", node=name)
    if row is not None:
        row.uses += 1
        row.last_used_at = now()
