"""Dashboard sessions: what the browser's cookie stands for.

Logging in with a token opens a session: a random secret of its own (stored as its sha256) that
the cookie holds, so the API token itself never sits in a browser's cookie jar. A session ends at
logout (revoked here, whatever copy of the cookie remains), after SESSION_S, when the token it was
opened with expires, is revoked or its principal is disabled, and, for the bootstrap admin token,
when that token is changed. Revoking a token revokes the sessions opened with it."""

from __future__ import annotations

import secrets
from datetime import timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.authz import BOOTSTRAP_ADMIN, Principal, Role, hash_token, same_secret
from control_plane.clock import now
from control_plane.models import UiSession
from control_plane.services.access import principals

SESSION_S = 12 * 3600
"""The longest a dashboard session lives (the token it was opened with may end it sooner)."""
SESSION_PREFIX = "tys_"


def open_session(session: Session, principal: Principal, *, admin_token: str | None) -> tuple[str, int]:
    """A new session for ``principal`` (authenticated by its token just now): the cookie's secret
    and how many seconds it lives. ``admin_token``: the bootstrap admin token, when that was used."""
    t = now()
    expires = t + timedelta(seconds=SESSION_S)
    if principal.token_id is not None:
        found = principals.token_of(session, principal.token_id)
        if found is not None and found[0].expires_at is not None:
            expires = min(expires, found[0].expires_at)
    secret = SESSION_PREFIX + secrets.token_urlsafe(32)
    session.add(UiSession(secret_hash=hash_token(secret), token_id=principal.token_id, created_at=t,
                          admin_token_hash=hash_token(admin_token) if admin_token is not None else None,
                          expires_at=expires))
    session.commit()
    return secret, max(int((expires - t).total_seconds()), 1)


def authenticate(session: Session, secret: str, *, admin_token: str | None, admin_tenant: str) -> Principal | None:
    """The principal of a live session, or None (unknown, ended, or its token no longer valid)."""
    if not secret.startswith(SESSION_PREFIX):
        return None
    row = session.scalar(select(UiSession).where(UiSession.secret_hash == hash_token(secret)))
    t = now()
    if row is None or row.revoked_at is not None or row.expires_at <= t:
        return None
    if row.token_id is None:
        if row.admin_token_hash is None or not admin_token or not same_secret(hash_token(admin_token),
                                                                              row.admin_token_hash):
            return None
        return Principal(name=BOOTSTRAP_ADMIN, tenant=admin_tenant, role=Role.admin)
    found = principals.token_of(session, row.token_id)
    if found is None or not principals.valid(*found, t):
        return None
    token, record = found
    return Principal(name=record.name, tenant=record.tenant, role=Role(record.role), token_id=token.id)


def close_session(session: Session, secret: str) -> bool:
    """End a session (logout); whether there was a live one."""
    done = session.execute(update(UiSession).where(UiSession.secret_hash == hash_token(secret),
                                                   UiSession.revoked_at.is_(None)).values(revoked_at=now()))
    session.commit()
    return bool(getattr(done, "rowcount", 0))
