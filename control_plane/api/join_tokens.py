"""/v1/join-tokens: bootstrap tokens for node agents (operators; docs/security.md)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, status

from control_plane.api.deps import JoinTokensManage, SessionDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.principals import JoinTokenCreated, JoinTokenIn, JoinTokenOut
from control_plane.services.access import join_tokens

router = APIRouter(prefix="/v1/join-tokens", tags=["cluster"], route_class=TransactionRoute)


@router.post("", response_model=JoinTokenCreated, status_code=status.HTTP_201_CREATED, responses=ERRORS,
             summary="Create a join token for agents")
def create_join_token(body: JoinTokenIn, session: SessionDep, caller: JoinTokensManage) -> JoinTokenCreated:
    """Single-use and valid for an hour unless told otherwise. Bound to `node_name`, it may also
    re-claim that registered node (its agent lost its credential). Shown once."""
    out, token = join_tokens.create(session, body, by=caller)
    return JoinTokenCreated(**out.model_dump(), token=token)


@router.get("", response_model=list[JoinTokenOut], responses=ERRORS, summary="List join tokens")
def list_join_tokens(session: SessionDep, _: JoinTokensManage) -> list[JoinTokenOut]:
    return join_tokens.list_tokens(session)


@router.delete("/{token_id}", response_model=JoinTokenOut, responses=ERRORS, summary="Revoke a join token")
def revoke_join_token(token_id: uuid.UUID, session: SessionDep, _: JoinTokensManage) -> JoinTokenOut:
    return join_tokens.revoke(session, token_id)
