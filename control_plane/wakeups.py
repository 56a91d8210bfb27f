"""Long-poll wake-ups (docs/architecture.md, "Heartbeat interval and long-poll wake-ups"): of node
agents (``POST /v1/agent/wait``) and of workers waiting for a checkpoint upload slot.

A change to a node's desired state (a new attempt part, a stop order) sends
``NOTIFY trainyard_node, '<node id>'`` in the transaction that makes it (``notify_nodes``), so the
wake-up is delivered if and only if the change commits; a grant of upload slots sends
``NOTIFY trainyard_upload_slot, '<slot key>'`` the same way (``notify``). Each replica listens on
one PostgreSQL connection per channel (``Wakeups.run``, an asyncio task; psycopg 3 async) and sets
the asyncio events of the waits it holds for that key; a change committed by this replica also
wakes its own waits at once, without the round trip (``install``: an ``after_commit`` hook). A
waiting request holds no thread and no database connection: only an event.

No module of the web framework is imported here: services call ``notify_nodes`` and ``notify``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Any, Protocol, TypeVar

import anyio.to_thread
import structlog
from sqlalchemy import event, text
from sqlalchemy.orm import Session, sessionmaker

log = structlog.get_logger("trainyard.wakeups")
T = TypeVar("T")


class RunInThread(Protocol):
    """Runs a blocking function in a worker thread and awaits its result (anyio.to_thread.run_sync, or
    the bookkeeping gate's ``Lanes.run_gated``)."""

    def __call__(self, fn: Callable[[], T], /) -> Awaitable[T]: ...

CHANNEL = "trainyard_node"
SLOT_CHANNEL = "trainyard_upload_slot"
_PENDING = "wake:"  # + channel, session.info key: keys to wake locally once the transaction commits


def notify(session: Session, channel: str, keys: Iterable[uuid.UUID | str]) -> None:
    """Wake the waits for these keys once the session's transaction commits (on every replica)."""
    ids = sorted({str(n) for n in keys})
    if not ids:
        return
    # One statement for all of them; PostgreSQL delivers each payload once per committed transaction.
    session.execute(text("SELECT pg_notify(:channel, n) FROM unnest(CAST(:ids AS text[])) AS n"),
                    {"channel": channel, "ids": ids})
    session.info.setdefault(_PENDING + channel, set()).update(ids)


def notify_nodes(session: Session, node_ids: Iterable[uuid.UUID | str]) -> None:
    """Wake the agents of these nodes once the session's transaction commits (on every replica)."""
    notify(session, CHANNEL, node_ids)


_started: weakref.WeakSet[Wakeups] = weakref.WeakSet()  # this process's, for drain_all


def drain_all() -> None:
    """This replica is stopping: every long poll it holds answers now (see ``Wakeups.drain``)."""
    for wakeups in list(_started):
        wakeups.drain()


class Busy(Exception):
    """This replica holds as many waits as it may (``agent_wait_max``)."""


class Wakeups:
    """The waits one replica holds on one channel, by key (a node id, an upload slot's key), and the
    listener that wakes them."""

    def __init__(self, database_url: str, *, max_waiters: int, channel: str = CHANNEL,
                 threads: int | None = None) -> None:
        """``threads``: the waits' reads (``wait``) run in a pool of that many threads of their own,
        not in the request threads (anyio's default pool) that heartbeats and reports fill."""
        self._threads = threads
        self._limiter: anyio.CapacityLimiter | None = None
        self._url = database_url.replace("postgresql+psycopg://", "postgresql://", 1)
        self.channel = channel
        self.max_waiters = max_waiters
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._lock = threading.Lock()  # ``keys`` is read from other threads
        self._count = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def waiting(self) -> int:
        return self._count

    # -- waits (the event loop's thread only) --

    def add(self, node_id: str) -> asyncio.Event:
        """Register a wait before reading the node's state, so no change between the read and the
        wait is missed. Raises Busy beyond ``max_waiters``."""
        return self.add_any([node_id])

    def add_any(self, keys: Iterable[str]) -> asyncio.Event:
        """One wait woken by a wake-up for any of ``keys`` (a batch of slot asks); it counts as one
        against ``max_waiters`` (one request held open, whatever its keys). Raises Busy beyond it."""
        if self._count >= self.max_waiters:
            raise Busy(f"{self._count} long polls ({self.channel}) already wait on this replica")
        ev = asyncio.Event()
        with self._lock:
            for key in keys:
                self._waiters.setdefault(key, set()).add(ev)
        self._count += 1
        return ev

    def remove(self, node_id: str, ev: asyncio.Event) -> None:
        self.remove_any([node_id], ev)

    def remove_any(self, keys: Iterable[str], ev: asyncio.Event) -> None:
        """End the wait ``ev`` registered for ``keys`` (``add_any``)."""
        held = False
        with self._lock:
            for key in keys:
                waiters = self._waiters.get(key)
                if waiters is not None and ev in waiters:
                    held = True
                    waiters.discard(ev)
                    if not waiters:
                        del self._waiters[key]
        if held:
            self._count -= 1

    def keys(self) -> list[str]:
        """The keys waited on now (thread-safe)."""
        with self._lock:
            return list(self._waiters)

    async def wait(self, node_id: str, change: Callable[[], T | None], timeout_s: float) -> T | None:
        """A long poll: what ``change()`` (run in a worker thread) says changed in the node's desired
        state, as soon as it says so, else None after ``timeout_s``. It reads once after the wait is
        registered (so no change between the agent's last answer and the wait is missed) and again
        each time the wait is woken (a wake-up may be for a change the agent already has, or for
        all waits after the listener reconnected); the wait goes on until the timeout."""
        ev = self.add(node_id)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while True:
                ev.clear()  # before the read: a wake-up during it is not lost
                found = await anyio.to_thread.run_sync(change, limiter=self._limiter)
                if found is not None:
                    return found
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0 or self._stopping:
                    return None
                try:
                    await asyncio.wait_for(ev.wait(), left)
                except TimeoutError:
                    return None
                if self._stopping:
                    return None
        finally:
            self.remove(node_id, ev)

    async def wait_until(self, key: str, first: Callable[[], T | None], then: Callable[[], T],
                         timeout_s: float, run: RunInThread | None = None) -> T:
        """A long poll on ``key``: the answer of ``first()`` (run in a worker thread, after the wait
        is registered, so no wake-up between the two is missed) if it has one, else that of
        ``then()`` after a wake-up or after ``timeout_s``. ``run`` runs each in a thread (default:
        anyio's pool, unbounded by anything else; the upload-slot long poll passes the bookkeeping
        gate's, control_plane/lanes.py)."""
        return await self.wait_any([key], first, then, timeout_s, run)

    async def wait_any(self, keys: Collection[str], first: Callable[[], T | None], then: Callable[[], T],
                       timeout_s: float, run: RunInThread | None = None) -> T:
        """``wait_until`` on several keys at once: ``then()`` runs after a wake-up for any of them
        (a batch of slot asks is answered when any of its slots is granted). Without keys it waits
        for nothing: ``then()`` follows ``first()`` at once."""
        in_thread: RunInThread = run or anyio.to_thread.run_sync
        keys = list(dict.fromkeys(keys))
        ev = self.add_any(keys)
        try:
            answer = await in_thread(first)
            if answer is not None:
                return answer
            if keys and not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(ev.wait(), timeout_s)
            return await in_thread(then)
        finally:
            self.remove_any(keys, ev)

    def _fire(self, node_ids: Iterable[str]) -> None:
        for node_id in node_ids:
            for ev in self._waiters.get(node_id, ()):
                ev.set()

    def _fire_all(self) -> None:
        self._fire(list(self._waiters))

    # -- wake-ups (any thread) --

    def wake_local(self, node_ids: Iterable[str]) -> None:
        """Wake this replica's waits for these nodes (thread-safe)."""
        ids = list(node_ids)
        loop = self._loop
        if ids and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._fire, ids)

    def install(self, factory: sessionmaker[Session]) -> None:
        """Wake local waits after a commit that notified (``notify_nodes``), without the listener."""

        pending = _PENDING + self.channel

        def after_commit(session: Session) -> None:
            ids = session.info.pop(pending, None)
            if ids:
                self.wake_local(ids)

        def after_rollback(session: Session) -> None:
            session.info.pop(pending, None)

        event.listen(factory, "after_commit", after_commit)
        event.listen(factory, "after_rollback", after_rollback)

    # -- the listener --

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._threads is not None:
            self._limiter = anyio.CapacityLimiter(self._threads)
        self._task = asyncio.create_task(self.run(), name=f"trainyard-wakeups-{self.channel}")
        _started.add(self)

    def drain(self) -> None:
        """The replica is stopping: every wait answers now, as after a wake-up that changed nothing
        the agent did not know, and a new wait does not block (any thread). The server calls it as
        its shutdown begins (control_plane/http_deadlines.py, DrainingServer): the app's own shutdown
        (``stop``) runs only once the requests in flight have ended, so without it a stopping
        replica held every long poll for its whole grace period, then cancelled them with an error
        each. The agents ask again, another replica or this one once it is back."""
        self._stopping = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._fire_all)

    async def stop(self) -> None:
        self._stopping = True
        _started.discard(self)
        self._fire_all()  # every wait answers now ("nothing changed")
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def run(self) -> None:
        """LISTEN on one connection, for as long as the replica runs; reconnect after a failure.
        After a (re)connect every wait is woken: a NOTIFY sent while not listening is not replayed,
        and a wait that returns "maybe changed" costs one heartbeat (or one slot poll)."""
        import psycopg

        backoff = 0.5
        while True:
            try:
                conn: Any = await psycopg.AsyncConnection.connect(self._url, autocommit=True, connect_timeout=5)
                try:
                    await conn.execute(f"LISTEN {self.channel}")
                    backoff = 0.5
                    self._fire_all()
                    async for note in conn.notifies():
                        self._fire((note.payload,))
                finally:
                    await conn.close()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the database went away: waits time out or are woken on return
                log.warning("wake-up listener lost its connection; reconnecting", error=str(exc), retry_in_s=backoff)
                await asyncio.sleep(backoff)
                backoff = min(10.0, backoff * 2)


NodeWakeups = Wakeups
"""The agents' long polls (``POST /v1/agent/wait``): a ``Wakeups`` on ``CHANNEL``."""
