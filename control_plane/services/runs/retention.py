"""Retention: worker logs, events and progress samples older than their settings are deleted, a
batch at a time.

Each statement deletes at most ``batch`` rows, in its own transaction, oldest first (by id, the
primary key: ids grow with time, so the oldest rows are found without a scan of the rest), so a
replica never holds long locks or bloats one transaction, and several replicas deleting at once
only split the work (``SKIP LOCKED``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import now
from control_plane.db import rowcount, session_scope
from control_plane.models import Event, LogChunk, ProgressSample, UiSession

MAX_BATCHES = 20
"""Batches per table and pass: the rest waits for the next pass."""


def _delete_older(factory: sessionmaker[Session], model: Any, days: float, batch: int, column: Any = None) -> int:
    if days <= 0:
        return 0
    when = model.created_at if column is None else column
    cutoff = now() - timedelta(days=days)
    deleted = 0
    for _ in range(MAX_BATCHES):
        with session_scope(factory) as s:
            doomed = (select(model.id).where(when < cutoff).order_by(model.id).limit(batch)
                      .with_for_update(skip_locked=True).scalar_subquery())
            n = rowcount(s.execute(delete(model).where(model.id.in_(doomed))))
        deleted += n
        if n < batch:
            break
    return deleted


def apply(factory: sessionmaker[Session], *, log_days: float, event_days: float, batch: int) -> tuple[int, int]:
    """One retention pass; returns (log chunks, events) deleted. Progress samples (the charts' history)
    go with the events."""
    events = _delete_older(factory, Event, event_days, batch)
    _delete_older(factory, UiSession, 1, batch, UiSession.expires_at)  # ended dashboard sessions
    _delete_older(factory, ProgressSample, event_days, batch, ProgressSample.at)
    return _delete_older(factory, LogChunk, log_days, batch), events
