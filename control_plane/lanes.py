"""The liveness lane: heartbeats never wait behind checkpoint bookkeeping (issue 27).

Sync routes run in one thread pool (``api_threads``) and share one GIL, so a burst of bookkeeping
(a 512-rank checkpoint's slot releases, storage grants, shard reports, events, logs: about 1,800
requests) used to queue every heartbeat behind it, until heartbeats timed out and healthy nodes
risked being declared lost. This ASGI middleware sorts each request by method and path
(``classify``) before any thread or database connection is taken:

- liveness (heartbeats, registrations, attempt status reports, which carry attempt-ending exits,
  and the health probes) is never held: it is counted, and its arrival time is stamped on the
  request (``ARRIVED_AT``), which the heartbeat records as the node's last heartbeat;
- bookkeeping (every other agent POST under ``/v1/agent/attempts/{id}/``) passes a gate: at most
  ``bookkeeping_concurrency`` in flight, and while any liveness request is in flight only one
  (a heartbeat competes with at most that many bookkeeping requests, for threads and for the GIL,
  and a new one is let in beside it only when none runs). One, not none: on a saturated replica
  liveness is nearly always in flight, and a gate that let nothing in beside it starved the
  bookkeeping into 503s (a slot release lost, its lease left to expire, in a CI run). Waiting
  costs an asyncio future, no thread and no connection. Past ``bookkeeping_queue_max`` waiting,
  or after ``bookkeeping_wait_s`` in the queue, the answer is 503 problem+json with Retry-After;
  agents resend (node_agent/link/client.py, relay.py; a slot release the agent holds and resends,
  link/upload_slots.py);
- everything else (long polls that hold no thread, users' API) passes untouched; the upload-slot
  long polls, a rank's and a node's batch, many per checkpoint, run their transactions through the
  gate (``run_gated``), holding a place only while one runs, never while they wait. (Gating the
  batch's request as well once made each batch wait behind itself: at one place, its own
  transaction queued behind its own request until the gate's wait ran out, 503.)

``GateBook`` is the gate's bookkeeping without asyncio (tests/control_plane/test_lanes.py checks its
properties); ``Lanes`` drives it from the event loop. docs/architecture.md, "Liveness lane".
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import anyio.to_thread
from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane import clock
from control_plane.errors import PROBLEM_JSON
from control_plane.limits_http import drain
from control_plane.wakeups import Busy

T = TypeVar("T")

ARRIVED_AT = "trainyard.arrived_at"
"""Scope key: the shared-clock instant (control_plane.clock.now) a liveness request arrived."""

BESIDE_LIVENESS = 1
"""Bookkeeping requests that may run while liveness is in flight (the gate's floor: never none)."""

RETRY_AFTER_S = 1
"""What a refused bookkeeping request is told to wait (agents add jitter)."""


class Lane(StrEnum):
    LIVENESS = "liveness"
    BOOKKEEPING = "bookkeeping"
    OTHER = "other"


_ATTEMPT_POST = re.compile(r"^/v1/agent/attempts/[^/]+/(?P<rest>.+)$")
_LIVENESS_POSTS = frozenset({"/v1/agent/heartbeat", "/v1/agent/register"})
_HEALTH = frozenset({"/healthz", "/readyz"})
_UNGATED_ATTEMPT_POSTS = frozenset({
    "status",  # liveness: a status report carries the exits that end attempts
    # Long polls holding no thread while they wait, whose transactions pass the gate themselves
    # (services/checkpoints/upload_slots.py, run_gated): gated here too, they would wait on themselves.
    "upload-slots",
    "upload-slots/batch",
})


def classify(method: str, path: str) -> Lane:
    """The lane of a request. ``POST /v1/agent/wait`` (a long poll holding no thread) and every
    non-agent route are OTHER: not gated."""
    if method == "GET" and path in _HEALTH:
        return Lane.LIVENESS
    if method != "POST":
        return Lane.OTHER
    if path in _LIVENESS_POSTS:
        return Lane.LIVENESS
    match = _ATTEMPT_POST.match(path)
    if match is None:
        return Lane.OTHER
    rest = match.group("rest").rstrip("/")
    if rest == "status":
        return Lane.LIVENESS
    if rest in _UNGATED_ATTEMPT_POSTS:
        return Lane.OTHER
    return Lane.BOOKKEEPING


class Admission(StrEnum):
    ADMITTED = "admitted"
    QUEUED = "queued"
    REFUSED = "refused"


@dataclass
class GateBook:
    """The gate's state, without clocks or asyncio: who is in flight, who waits, who goes next.

    Invariants (tests/control_plane/test_lanes.py): bookkeeping in flight never exceeds ``bound``;
    while a liveness request is in flight a bookkeeping request is admitted only when none is in
    flight (``BESIDE_LIVENESS``); waiters are admitted in arrival order; the queue never holds more
    than ``queue_max``."""

    bound: int
    queue_max: int
    liveness: int = 0
    """Liveness requests arrived and not yet answered."""
    in_flight: int = 0
    """Bookkeeping requests admitted and not yet answered."""

    def __post_init__(self) -> None:
        if self.bound < 1 or self.queue_max < 0:
            raise ValueError("the gate needs bound >= 1 and queue_max >= 0")
        self.waiting: deque[int] = deque()

    def limit(self) -> int:
        """How many bookkeeping requests may be in flight now."""
        return self.bound if self.liveness == 0 else min(self.bound, BESIDE_LIVENESS)

    def liveness_arrived(self) -> None:
        self.liveness += 1

    def liveness_done(self) -> list[int]:
        """A liveness request answered; returns the waiters this admits."""
        assert self.liveness > 0
        self.liveness -= 1
        return self._admit()

    def bookkeeping_arrived(self, ticket: int) -> Admission:
        # Admitted at once only with nobody ahead of it: arrival order within the lane.
        if not self.waiting and self.in_flight < self.limit():
            self.in_flight += 1
            return Admission.ADMITTED
        if len(self.waiting) >= self.queue_max:
            return Admission.REFUSED
        self.waiting.append(ticket)
        return Admission.QUEUED

    def bookkeeping_done(self) -> list[int]:
        """An admitted bookkeeping request answered; returns the waiters this admits."""
        assert self.in_flight > 0
        self.in_flight -= 1
        return self._admit()

    def abandon(self, ticket: int) -> bool:
        """A waiter gave up (timed out, cancelled); False when it was admitted meanwhile."""
        try:
            self.waiting.remove(ticket)
        except ValueError:
            return False
        return True

    def _admit(self) -> list[int]:
        admitted: list[int] = []
        while self.waiting and self.in_flight < self.limit():
            admitted.append(self.waiting.popleft())
            self.in_flight += 1
        return admitted


@dataclass(frozen=True)
class LaneFigures:
    """What /metrics shows of one replica's lanes (services/read/metrics.py)."""

    liveness_in_flight: int
    liveness_oldest_s: float
    liveness_total: int
    bookkeeping_in_flight: int
    bookkeeping_queued: int
    bookkeeping_waits: int
    """Bookkeeping requests that had to queue (admitted later, or refused after a wait)."""
    bookkeeping_wait_seconds: float
    bookkeeping_refused: int
    bookkeeping_total: int


class Lanes:
    """One replica's lanes, driven from its event loop; ``oldest_liveness_s`` and ``figures`` may be
    read from any thread (the monitor loop, /metrics)."""

    def __init__(self, *, bookkeeping_concurrency: int, queue_max: int, wait_s: float, gated: bool = True) -> None:
        self.book = GateBook(bound=bookkeeping_concurrency, queue_max=queue_max)
        self.gated = gated
        """False (settings.bookkeeping_gate): bookkeeping is counted, never held; liveness is still stamped
        and counted (the lost guard)."""
        self.wait_s = wait_s
        self._tickets = itertools.count()
        self._waiters: dict[int, asyncio.Future[None]] = {}
        self._lock = threading.Lock()  # guards _arrivals, read by the monitor's thread
        self._arrivals: dict[int, float] = {}  # liveness ticket -> monotonic arrival
        self._liveness_total = 0
        self._bookkeeping_total = 0
        self._waits = 0
        self._wait_seconds = 0.0
        self._refused = 0

    # -- liveness -----------------------------------------------------------------------------
    def liveness_arrived(self) -> int:
        ticket = next(self._tickets)
        self.book.liveness_arrived()
        with self._lock:
            self._arrivals[ticket] = time.monotonic()
        self._liveness_total += 1
        return ticket

    def liveness_done(self, ticket: int) -> None:
        with self._lock:
            self._arrivals.pop(ticket, None)
        self._wake(self.book.liveness_done())

    def oldest_liveness_s(self) -> float:
        """How long the oldest liveness request still unanswered has been here (0: none)."""
        with self._lock:
            oldest = min(self._arrivals.values(), default=None)
        return 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)

    # -- bookkeeping --------------------------------------------------------------------------
    async def admit(self) -> bool:
        """Wait for the gate; False when refused (the queue is full or the wait ran out)."""
        self._bookkeeping_total += 1
        if not self.gated:
            return True
        ticket = next(self._tickets)
        admission = self.book.bookkeeping_arrived(ticket)
        if admission is Admission.ADMITTED:
            return True
        if admission is Admission.REFUSED:
            self._refused += 1
            return False
        self._waits += 1
        started = time.monotonic()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket] = future
        try:
            await asyncio.wait_for(asyncio.shield(future), self.wait_s)
            return True
        except TimeoutError:
            if self.book.abandon(ticket):
                self._refused += 1
                return False
            return True  # admitted as the wait ran out: it holds a place, so it goes ahead
        except asyncio.CancelledError:
            if not self.book.abandon(ticket):
                self.done()  # admitted meanwhile: give the place back
            raise
        finally:
            self._waiters.pop(ticket, None)
            self._wait_seconds += time.monotonic() - started

    async def run_gated(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a worker thread as bookkeeping: through the gate, holding its place only while
        it runs. For work an ungated request does in threads between waits (the upload-slot long
        poll's transactions); raises Busy (503 with Retry-After) where the gate refuses."""
        if not await self.admit():
            raise Busy("too many checkpoint and progress reports are waiting behind heartbeats")
        try:
            return await anyio.to_thread.run_sync(fn)
        finally:
            self.done()

    def done(self) -> None:
        """An admitted bookkeeping request answered."""
        if self.gated:
            self._wake(self.book.bookkeeping_done())

    def _wake(self, tickets: list[int]) -> None:
        for ticket in tickets:
            future = self._waiters.get(ticket)
            if future is not None and not future.done():
                future.set_result(None)

    def figures(self) -> LaneFigures:
        return LaneFigures(
            liveness_in_flight=self.book.liveness, liveness_oldest_s=self.oldest_liveness_s(),
            liveness_total=self._liveness_total, bookkeeping_in_flight=self.book.in_flight,
            bookkeeping_queued=len(self.book.waiting), bookkeeping_waits=self._waits,
            bookkeeping_wait_seconds=self._wait_seconds, bookkeeping_refused=self._refused,
            bookkeeping_total=self._bookkeeping_total)


class LaneMiddleware:
    """Puts each request in its lane (module docstring)."""

    def __init__(self, app: ASGIApp, lanes: Lanes) -> None:
        self.app = app
        self.lanes = lanes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        lane = classify(scope.get("method", ""), scope.get("path", ""))
        if lane is Lane.LIVENESS:
            scope[ARRIVED_AT] = clock.now()
            ticket = self.lanes.liveness_arrived()
            try:
                await self.app(scope, receive, send)
            finally:
                self.lanes.liveness_done(ticket)
            return
        if lane is Lane.OTHER:
            await self.app(scope, receive, send)
            return
        if not await self.lanes.admit():
            await drain(receive)  # read before answering, or the client may see a reset (limits_http)
            await _busy(scope, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.lanes.done()


async def _busy(scope: Scope, send: Send) -> None:
    body = json.dumps({
        "type": "https://trainyard.dev/problems/unavailable",
        "title": "The control plane is busy; retry",
        "status": 503,
        "detail": "too many checkpoint and progress reports are waiting behind heartbeats on this replica",
        "instance": scope.get("path", ""),
    }).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
