"""/v1/principals, /v1/tokens, /v1/whoami: who may call the API (docs/security.md)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from control_plane.api.deps import PrincipalsManage, SelfDep, SessionDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.principals import (
    PRINCIPAL_NAME,
    PrincipalCreated,
    PrincipalIn,
    PrincipalOut,
    TokenCreated,
    TokenIn,
    TokenOut,
    WhoAmI,
)
from control_plane.services.access import principals

router = APIRouter(prefix="/v1", tags=["access"], route_class=TransactionRoute)

PrincipalName = Annotated[str, Path(min_length=1, max_length=128, pattern=PRINCIPAL_NAME)]


@router.get("/whoami", response_model=WhoAmI, responses=ERRORS, summary="The caller's principal")
def whoami(caller: SelfDep) -> WhoAmI:
    return WhoAmI(name=caller.name, tenant=caller.tenant, role=caller.role,
                  token_id=str(caller.token_id) if caller.token_id else None)


@router.post("/principals", response_model=PrincipalCreated, status_code=status.HTTP_201_CREATED, responses=ERRORS,
             summary="Create a principal and its first token")
def create_principal(body: PrincipalIn, session: SessionDep, caller: PrincipalsManage) -> PrincipalCreated:
    """The token in the answer is shown once: only its sha256 is stored."""
    out, row, token = principals.create_principal(session, body, by=caller)
    return PrincipalCreated(**out.model_dump(), token=token, token_id=str(row.id))


@router.get("/principals", response_model=list[PrincipalOut], responses=ERRORS, summary="List principals")
def list_principals(session: SessionDep, _: PrincipalsManage) -> list[PrincipalOut]:
    return principals.list_principals(session)


@router.delete("/principals/{name}", response_model=PrincipalOut, responses=ERRORS, summary="Disable a principal")
def disable_principal(name: PrincipalName, session: SessionDep, _: PrincipalsManage) -> PrincipalOut:
    """Every token of it is revoked and refused from now on; its jobs are left as they are."""
    return principals.disable_principal(session, name)


@router.post("/tokens", response_model=TokenCreated, status_code=status.HTTP_201_CREATED, responses=ERRORS,
             summary="Create an API token")
def create_token(body: TokenIn, session: SessionDep, caller: SelfDep) -> TokenCreated:
    """For the caller (rotation: create the new one, then revoke the old one), or, for an admin, for
    the named `principal`. Shown once."""
    row, token, owner = principals.create_token(session, body, caller=caller)
    return TokenCreated(**principals.token_out(row, owner).model_dump(), token=token)


@router.get("/tokens", response_model=list[TokenOut], responses=ERRORS, summary="List API tokens")
def list_tokens(session: SessionDep, caller: SelfDep,
                principal: Annotated[str | None, Query(max_length=128, pattern=PRINCIPAL_NAME)] = None,
                ) -> list[TokenOut]:
    """The caller's tokens; an admin sees everyone's (or one principal's). Never the secrets."""
    return principals.list_tokens(session, caller=caller, principal=principal)


@router.delete("/tokens/{token_id}", response_model=TokenOut, responses=ERRORS, summary="Revoke an API token")
def revoke_token(token_id: uuid.UUID, session: SessionDep, caller: SelfDep) -> TokenOut:
    return principals.revoke_token(session, token_id, caller=caller)
