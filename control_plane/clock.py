"""The control plane's time: the database's clock, read without a round trip per call.

Every liveness, time-limit, timeout and ordering decision compares instants that several replicas
wrote. A replica's wall clock can be off by seconds or minutes (NTP not yet synced, a VM resumed,
an operator's mistake), so those instants come from one clock all replicas share: PostgreSQL's.

``anchor(engine)`` reads ``clock_timestamp()`` once and pins it to this process's monotonic clock
(which a wall-clock step does not move); ``now()`` is then that instant plus the monotonic time
elapsed since, good to about half the round trip. The loops re-anchor periodically (``maybe_anchor``)
so monotonic drift stays far below a heartbeat. Before the first anchor (unit tests, tools), ``now()``
is the wall clock. A simulation (bench/scheduler.py) or a test replaces the clock with
``use_clock``. docs/architecture.md, "Time and timeouts".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, text

REANCHOR_S = 30.0
"""How often the loops re-read the database clock (``maybe_anchor``)."""

_lock = threading.Lock()
_override: Callable[[], datetime] | None = None
_anchor: tuple[datetime, float] | None = None  # (database time, monotonic time) at one instant
_anchored_at_mono = 0.0


def wall() -> datetime:
    """This machine's wall clock: for what is shown, never for a decision between replicas."""
    return datetime.now(UTC)


def now() -> datetime:
    """The shared clock (aware UTC): the database's time, or the clock given to ``use_clock``."""
    if _override is not None:
        return _override()
    anchor = _anchor
    if anchor is None:
        return wall()
    db_time, mono = anchor
    return db_time + timedelta(seconds=time.monotonic() - mono)


def anchor(engine: Engine) -> timedelta:
    """Read the database clock and pin ``now()`` to it; returns how far the wall clock is off."""
    global _anchor, _anchored_at_mono
    with engine.connect() as conn:
        before = time.monotonic()
        db_time = conn.execute(text("SELECT clock_timestamp()")).scalar_one()
        after = time.monotonic()
    if db_time.tzinfo is None:
        db_time = db_time.replace(tzinfo=UTC)
    mid = (before + after) / 2
    with _lock:
        _anchor = (db_time, mid)
        _anchored_at_mono = after
    return wall() - (db_time + timedelta(seconds=time.monotonic() - mid))


def maybe_anchor(engine: Engine, every_s: float = REANCHOR_S) -> None:
    """Re-anchor if the last anchor is older than ``every_s`` (or there is none)."""
    if _anchor is None or time.monotonic() - _anchored_at_mono >= every_s:
        anchor(engine)


def use_clock(clock: Callable[[], datetime] | None) -> None:
    """Replace the clock (None: the anchored database clock again). For simulations and tests."""
    global _override
    _override = clock


def reset() -> None:
    """Forget the anchor (tests that start several control planes on different databases)."""
    global _anchor
    with _lock:
        _anchor = None
