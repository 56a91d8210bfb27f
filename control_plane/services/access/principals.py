"""Principals and their API tokens: create (the token shown once), list, revoke, authenticate.

Tokens are stored as their sha256 (authz.hash_token), never in plaintext. The bootstrap admin
token (TRAINYARD_ADMIN_TOKEN) has no row; it is checked in api/deps.py before any lookup here.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from sqlalchemy import func, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.authz import BOOTSTRAP_ADMIN, USER_TOKEN_PREFIX, Principal, Role, hash_token, new_token
from control_plane.clock import now
from control_plane.errors import Conflict, Forbidden, NotFound, Unprocessable
from control_plane.models import ApiToken, PrincipalRecord
from control_plane.schemas.principals import PrincipalIn, PrincipalOut, TokenIn, TokenOut

LAST_USED_GRANULARITY_S = 60
"""last_used_at is written at most this often per token: not one write per request."""


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal of a valid API token (not revoked, not expired, principal not disabled)."""
    if not token.startswith(USER_TOKEN_PREFIX):
        return None
    row = session.execute(
        select(ApiToken, PrincipalRecord).join(PrincipalRecord, PrincipalRecord.id == ApiToken.principal_id)
        .where(ApiToken.token_hash == hash_token(token))
    ).one_or_none()
    if row is None:
        return None
    api_token, record = row
    t = now()
    if not valid(api_token, record, t):
        return None
    if api_token.last_used_at is None or (t - api_token.last_used_at).total_seconds() > LAST_USED_GRANULARITY_S:
        session.execute(update(ApiToken).where(ApiToken.id == api_token.id).values(last_used_at=t))
    return Principal(name=record.name, tenant=record.tenant, role=Role(record.role), token_id=api_token.id)


def valid(api_token: ApiToken, record: PrincipalRecord, t: datetime) -> bool:
    """Whether a token still authenticates its principal at ``t``."""
    if api_token.revoked_at is not None or record.disabled_at is not None:
        return False
    return api_token.expires_at is None or api_token.expires_at > t


def token_of(session: Session, token_id: uuid.UUID) -> tuple[ApiToken, PrincipalRecord] | None:
    row = session.execute(
        select(ApiToken, PrincipalRecord).join(PrincipalRecord, PrincipalRecord.id == ApiToken.principal_id)
        .where(ApiToken.id == token_id)).one_or_none()
    return None if row is None else (row[0], row[1])


def _issue(session: Session, record: PrincipalRecord, *, by: str, description: str,
           ttl_s: int | None, parent: ApiToken | None = None) -> tuple[ApiToken, str]:
    """A new token; one made with ``parent`` for the parent's own principal expires no later than
    it (a stolen short-lived token cannot mint a permanent one). Revoking the parent leaves it be:
    rotation (make a new token, revoke the old) must keep working."""
    token = new_token(USER_TOKEN_PREFIX)
    t = now()
    expires = t + timedelta(seconds=ttl_s) if ttl_s else None
    if parent is not None and parent.expires_at is not None:
        expires = parent.expires_at if expires is None else min(expires, parent.expires_at)
    row = ApiToken(id=uuid.uuid4(), principal_id=record.id, token_hash=hash_token(token), description=description,
                   created_by=by, created_at=t, expires_at=expires,
                   parent_id=parent.id if parent is not None else None)
    session.add(row)
    return row, token


def create_principal(session: Session, body: PrincipalIn, *, by: Principal) -> tuple[PrincipalOut, ApiToken, str]:
    """A new principal with its first token; the token is returned once, never stored."""
    if body.name == BOOTSTRAP_ADMIN:
        raise Conflict(f"{BOOTSTRAP_ADMIN!r} is the bootstrap admin's name; choose another")
    record = PrincipalRecord(id=uuid.uuid4(), name=body.name, tenant=body.tenant, role=body.role.value,
                             created_by=by.name, created_at=now())
    session.add(record)
    try:
        session.flush()
    except IntegrityError as exc:
        session.rollback()
        raise Conflict(f"a principal named {body.name!r} exists") from exc
    row, token = _issue(session, record, by=by.name, description="first token", ttl_s=body.token_ttl_s)
    session.commit()
    return principal_out(session, record), row, token


def _record(session: Session, name: str) -> PrincipalRecord:
    record = session.scalar(select(PrincipalRecord).where(PrincipalRecord.name == name))
    if record is None:
        raise NotFound(f"principal {name!r} does not exist")
    return record


def principal_out(session: Session, record: PrincipalRecord) -> PrincipalOut:
    live = session.scalar(select(func.count()).select_from(ApiToken).where(
        ApiToken.principal_id == record.id, ApiToken.revoked_at.is_(None),
        or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now()))) or 0
    return PrincipalOut(id=str(record.id), name=record.name, tenant=record.tenant, role=Role(record.role),
                        created_by=record.created_by, created_at=record.created_at,
                        disabled_at=record.disabled_at, tokens=live)


def list_principals(session: Session) -> list[PrincipalOut]:
    return [principal_out(session, r) for r in session.scalars(select(PrincipalRecord).order_by(PrincipalRecord.name))]


def disable_principal(session: Session, name: str) -> PrincipalOut:
    """Refuse every token of the principal from now on (they are revoked too). Its jobs stay."""
    record = _record(session, name)
    t = now()
    if record.disabled_at is None:
        record.disabled_at = t
    session.execute(update(ApiToken).where(ApiToken.principal_id == record.id, ApiToken.revoked_at.is_(None))
                    .values(revoked_at=t))
    session.commit()
    return principal_out(session, record)


def create_token(session: Session, body: TokenIn, *, caller: Principal) -> tuple[ApiToken, str, str]:
    """A new token for the caller, or (an admin) for the named principal. Returns the row, the
    token (shown once) and the owner's name."""
    name = body.principal or caller.name
    if name != caller.name and not caller.is_admin:
        raise Forbidden("only an admin creates tokens for another principal")
    if name == BOOTSTRAP_ADMIN and caller.token_id is None:
        raise Unprocessable("the bootstrap admin token is configured (TRAINYARD_ADMIN_TOKEN), not issued: create "
                            "an admin principal (POST /v1/principals) and tokens for it", field="principal")
    record = _record(session, name)
    if record.disabled_at is not None:
        raise Conflict(f"principal {name!r} is disabled")
    parent = session.get(ApiToken, caller.token_id) if caller.token_id is not None and name == caller.name else None
    row, token = _issue(session, record, by=caller.name, description=body.description, ttl_s=body.ttl_s,
                        parent=parent)
    session.commit()
    return row, token, record.name


def list_tokens(session: Session, *, caller: Principal, principal: str | None) -> list[TokenOut]:
    """The caller's tokens; an admin's: everyone's, or the named principal's."""
    stmt = (select(ApiToken, PrincipalRecord.name).join(PrincipalRecord, PrincipalRecord.id == ApiToken.principal_id)
            .order_by(ApiToken.created_at, ApiToken.id))
    if not caller.is_admin:
        if principal not in (None, caller.name):
            raise Forbidden("only an admin lists another principal's tokens")
        principal = caller.name
    if principal is not None:
        stmt = stmt.where(PrincipalRecord.name == principal)
    return [token_out(t, n) for t, n in session.execute(stmt)]


def revoke_token(session: Session, token_id: uuid.UUID, *, caller: Principal) -> TokenOut:
    """Revoke one of the caller's tokens (an admin: anyone's). Another's token is 404 to a non-admin."""
    row = session.execute(
        select(ApiToken, PrincipalRecord.name).join(PrincipalRecord, PrincipalRecord.id == ApiToken.principal_id)
        .where(ApiToken.id == token_id).with_for_update(of=ApiToken)
    ).one_or_none()
    if row is None or (not caller.is_admin and row[1] != caller.name):
        raise NotFound(f"token {token_id} does not exist")
    token, owner = row
    t = now()
    if token.revoked_at is None:
        token.revoked_at = t
    session.commit()
    return token_out(token, owner)


def token_out(token: ApiToken, owner: str) -> TokenOut:
    return TokenOut(id=str(token.id), principal=owner, description=token.description, created_by=token.created_by,
                    created_at=token.created_at, expires_at=token.expires_at, last_used_at=token.last_used_at,
                    revoked_at=token.revoked_at)
