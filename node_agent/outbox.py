"""The agent's outbox: checkpoint shards and worker events queued per attempt for the relay
(node_agent/relay.py), bounded, oldest dropped first. The bounds and what a drop tells whom are in
relay.py's docstring."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, Literal

import structlog

from trainyard.protocol.agent import ShardInfo, WorkerEvent

log = structlog.get_logger(__name__)

Kind = Literal["shard", "event"]
MAX_ITEMS_PER_ATTEMPT = 10_000
MAX_BYTES_PER_ATTEMPT = 8 * 1024 * 1024
DROPPED_EVENT = "agent.outbox_dropped"
MAX_BATCH = 100


class Waiter:
    """The outcome of one queued item, for a worker waiting on it: (HTTP status, JSON body)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.status = HTTPStatus.GATEWAY_TIMEOUT
        self.payload: dict[str, Any] = {}

    def resolve(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        if not self._done.is_set():  # the first outcome counts
            self.status, self.payload = status, payload
            self._done.set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


@dataclass
class _Item:
    seq: int
    kind: Kind
    body: ShardInfo | WorkerEvent
    waiter: Waiter | None
    size: int = 0
    notice: bool = False
    """The agent's own DROPPED_EVENT, never dropped itself."""


@dataclass
class _Queue:
    items: deque[_Item] = field(default_factory=deque)
    single_until: int = -1
    """Items up to this seq go one per batch (resending a rejected batch)."""
    dropped: int = 0
    size: int = 0
    """Bytes of the queued items' JSON."""
    notice: _Item | None = None
    """The DROPPED_EVENT still queued and not yet taken into a batch: new drops are added to it."""


@dataclass(frozen=True)
class Batch:
    attempt_id: str
    kind: Kind
    items: tuple[_Item, ...]

    @property
    def last_seq(self) -> int:
        return self.items[-1].seq

    def __len__(self) -> int:
        return len(self.items)


class Outbox:
    """Thread-safe per-attempt FIFO of shards and events waiting for the control plane."""

    def __init__(
        self, *, max_items: int = MAX_ITEMS_PER_ATTEMPT, max_batch: int = MAX_BATCH,
        max_bytes: int = MAX_BYTES_PER_ATTEMPT,
    ) -> None:
        if max_items < 2 or max_batch < 1 or max_bytes < 1:
            raise ValueError("max_items must be >= 2, max_batch and max_bytes >= 1")
        self.max_items = max_items
        self.max_batch = max_batch
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._queues: dict[str, _Queue] = {}
        self._seq = 0
        self._changes = 0
        self._seen = 0
        self._closed = False

    def put(self, attempt_id: str, kind: Kind, body: ShardInfo | WorkerEvent, *, wait: bool = False) -> Waiter | None:
        """Queue an item; with `wait`, return the Waiter its acknowledgement resolves."""
        waiter = Waiter() if wait else None
        with self._cond:
            if self._closed:
                if waiter is not None:
                    waiter.resolve(HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "the agent is shutting down"})
                return waiter
            queue = self._queues.setdefault(attempt_id, _Queue())
            size = len(body.model_dump_json())
            while queue.items and (len(queue.items) >= self.max_items or queue.size + size > self.max_bytes):
                if not self._drop_oldest(attempt_id, queue):
                    break
            self._seq += 1
            queue.items.append(_Item(self._seq, kind, body, waiter, size))
            queue.size += size
            self._changes += 1
            self._cond.notify_all()
        return waiter

    def _drop_oldest(self, attempt_id: str, queue: _Queue) -> bool:
        """Drop the oldest event, else the oldest shard, and count it in the queue's notice;
        False when nothing but notices is left. Called with the lock held."""
        victim = next((i for i in queue.items if i.kind == "event" and not i.notice), None)
        victim = victim or next((i for i in queue.items if i.kind == "shard"), None)
        if victim is None:
            return False
        queue.items.remove(victim)
        queue.size -= victim.size
        queue.dropped += 1
        if queue.dropped == 1 or queue.dropped % 1000 == 0:
            log.warning("outbox_full_dropped_oldest", attempt_id=attempt_id, kind=victim.kind,
                        dropped=queue.dropped, max_items=self.max_items, max_bytes=self.max_bytes)
        if victim.waiter is not None:
            victim.waiter.resolve(HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "dropped: the agent's outbox is full"})
        if queue.notice is None:
            notice = WorkerEvent(rank=victim.body.rank, kind=DROPPED_EVENT, at=datetime.now(UTC),
                                 message="the agent's outbox for this attempt was full; the oldest items were dropped",
                                 data={"events": 0, "shards": 0, "bytes": 0})
            self._seq += 1
            queue.notice = _Item(self._seq, "event", notice, None, len(notice.model_dump_json()), notice=True)
            queue.items.append(queue.notice)
            queue.size += queue.notice.size
        body = queue.notice.body
        assert isinstance(body, WorkerEvent)
        body.data[f"{victim.kind}s"] += 1
        body.data["bytes"] += victim.size
        return True

    def pending(self, attempt_id: str) -> int:
        """Items of the attempt not yet acknowledged (an in-flight batch included)."""
        with self._cond:
            queue = self._queues.get(attempt_id)
            return 0 if queue is None else len(queue.items)

    def attempts(self) -> list[str]:
        with self._cond:
            return [attempt_id for attempt_id, queue in self._queues.items() if queue.items]

    def next_batch(self, attempt_id: str) -> Batch | None:
        """The oldest items of one kind, left queued until `settle` is called for them."""
        with self._cond:
            queue = self._queues.get(attempt_id)
            if queue is None or not queue.items:
                return None
            head = queue.items[0]
            limit = 1 if head.seq <= queue.single_until else self.max_batch
            items: list[_Item] = []
            for item in queue.items:
                if item.kind != head.kind or len(items) >= limit:
                    break
                items.append(item)
            if queue.notice is not None and queue.notice in items:
                queue.notice = None  # on its way: later drops start a new one
            return Batch(attempt_id, head.kind, tuple(items))

    def settle(self, batch: Batch, status: HTTPStatus, payload: dict[str, Any]) -> None:
        """The batch is done with (acknowledged, or refused for good): unqueue it, tell its waiters."""
        with self._cond:
            queue = self._queues.get(batch.attempt_id)
            # By seq: the queue may have lost its oldest items (overflow, drop) meanwhile.
            while queue is not None and queue.items and queue.items[0].seq <= batch.last_seq:
                queue.size -= queue.items.popleft().size
        for item in batch.items:
            if item.waiter is not None:
                item.waiter.resolve(status, payload)

    def send_singly(self, batch: Batch) -> None:
        with self._cond:
            queue = self._queues.get(batch.attempt_id)
            if queue is not None:
                queue.single_until = max(queue.single_until, batch.last_seq)

    def drop(self, attempt_id: str, status: HTTPStatus, detail: str) -> int:
        """Forget the attempt's queue; its waiters get `status`. Returns how many items were queued."""
        with self._cond:
            queue = self._queues.pop(attempt_id, None)
        items = list(queue.items) if queue is not None else []
        for item in items:
            if item.waiter is not None:
                item.waiter.resolve(status, {"detail": detail})
        return len(items)

    def wait(self, timeout: float) -> None:
        """Return once something was queued since the last call (or `wake`), or after `timeout`."""
        with self._cond:
            self._cond.wait_for(lambda: self._changes != self._seen or self._closed, max(0.0, timeout))
            self._seen = self._changes

    def wake(self) -> None:
        with self._cond:
            self._changes += 1
            self._cond.notify_all()

    def close(self) -> int:
        """Refuse new items, release every waiter (503). Returns how many items were still queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            attempt_ids = list(self._queues)
        return sum(self.drop(a, HTTPStatus.SERVICE_UNAVAILABLE, "the agent is shutting down") for a in attempt_ids)
