"""The event log: every state change and decision writes one, in the same transaction."""

from __future__ import annotations

import uuid
from typing import Any

import structlog
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Event

log = structlog.get_logger("trainyard.events")


def record(
    session: Session,
    kind: str,
    message: str,
    *,
    job_id: uuid.UUID | None = None,
    attempt_id: uuid.UUID | None = None,
    node_id: uuid.UUID | None = None,
    **data: Any,
) -> Event:
    event = Event(
        kind=kind, message=message, job_id=job_id, attempt_id=attempt_id, node_id=node_id, data=data
    )
    session.add(event)
    log.info(
        message,
        kind=kind,
        job_id=str(job_id) if job_id else None,
        attempt_id=str(attempt_id) if attempt_id else None,
        node_id=str(node_id) if node_id else None,
        **data,
    )
    return event


def list_events(
    session: Session, *, job_id: uuid.UUID | None = None, after: int = 0, limit: int = 100
) -> list[Event]:
    stmt = select(Event).where(Event.id > after).order_by(Event.id).limit(limit)
    if job_id is not None:
        stmt = stmt.where(Event.job_id == job_id)
    return list(session.scalars(stmt))


def recent_events(session: Session, job_id: uuid.UUID, limit: int) -> list[Event]:
    """The job's newest ``limit`` events, oldest first."""
    newest = session.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id.desc()).limit(limit))
    return list(reversed(list(newest)))
