"""The agent's outbox: checkpoint shards and worker events queued per attempt for the relay
(node_agent/link/relay.py), bounded, oldest dropped first. The bounds and what a drop tells whom are in
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
MAX_ITEMS_PER_NODE = 50_000
"""The node's budget over every attempt's queue (AgentConfig.outbox_max_items)."""
MAX_BYTES_PER_NODE = 64 * 1024 * 1024
"""The node's budget in bytes of the queued items' JSON (AgentConfig.outbox_max_bytes)."""
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
    """Thread-safe per-attempt FIFO of shards and events waiting for the control plane.

    Two budgets bound it: each attempt's (`max_items`, `max_bytes`) and the node's, over every
    attempt together (`node_max_items`, `node_max_bytes`), so that many attempts, or one node part
    with many ranks, cannot grow the agent without bound. Past the node's budget the items dropped
    are those of the attempt holding the most of it (its oldest event first, then its oldest
    shard): an attempt within its fair share of the node (the budget over the attempts queued)
    never loses an item to another's flood.
    """

    def __init__(
        self, *, max_items: int = MAX_ITEMS_PER_ATTEMPT, max_batch: int = MAX_BATCH,
        max_bytes: int = MAX_BYTES_PER_ATTEMPT, node_max_items: int = MAX_ITEMS_PER_NODE,
        node_max_bytes: int = MAX_BYTES_PER_NODE,
    ) -> None:
        if min(max_items, node_max_items) < 2 or max_batch < 1 or min(max_bytes, node_max_bytes) < 1:
            raise ValueError("max_items and node_max_items must be >= 2, max_batch, max_bytes and node_max_bytes >= 1")
        self.max_items = max_items
        self.max_batch = max_batch
        self.max_bytes = max_bytes
        self.node_max_items = node_max_items
        self.node_max_bytes = node_max_bytes
        self._cond = threading.Condition()
        self._queues: dict[str, _Queue] = {}
        self._items = 0
        self._bytes = 0
        """Items and bytes queued over every attempt (the node's budget)."""
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
                if not self._drop_oldest(attempt_id, queue, node=False):
                    break
            self._make_room(attempt_id, size)
            self._seq += 1
            self._add(queue, _Item(self._seq, kind, body, waiter, size))
            self._changes += 1
            self._cond.notify_all()
        return waiter

    def usage(self) -> tuple[int, int]:
        """(items, bytes) queued over every attempt."""
        with self._cond:
            return self._items, self._bytes

    def _make_room(self, attempt_id: str, size: int) -> None:
        """Drop from the attempt holding the most until an item of `size` for `attempt_id` fits the
        node's budget. Called with the lock held."""
        spent: set[str] = set()  # attempts with nothing but notices left
        while self._items >= self.node_max_items or self._bytes + size > self.node_max_bytes:
            by_bytes = self._bytes + size > self.node_max_bytes
            # The incoming item counts as its attempt's, and a tie costs that attempt.
            held = {aid: ((queue.size + size if aid == attempt_id else queue.size) if by_bytes
                          else len(queue.items) + (aid == attempt_id), aid == attempt_id)
                    for aid, queue in self._queues.items() if queue.items and aid not in spent}
            if not held:
                return
            victim = max(held, key=held.__getitem__)
            if not self._drop_oldest(victim, self._queues[victim], node=True):
                spent.add(victim)

    def _add(self, queue: _Queue, item: _Item) -> None:
        queue.items.append(item)
        queue.size += item.size
        self._items += 1
        self._bytes += item.size

    def _forget(self, queue: _Queue, item: _Item) -> None:
        """Account for `item` having left `queue` (the caller took it out)."""
        queue.size -= item.size
        self._items -= 1
        self._bytes -= item.size

    def _drop_oldest(self, attempt_id: str, queue: _Queue, *, node: bool) -> bool:
        """Drop the oldest event, else the oldest shard, and count it in the queue's notice;
        False when nothing but notices is left. `node`: for the node's budget, not the attempt's.
        Called with the lock held."""
        victim = next((i for i in queue.items if i.kind == "event" and not i.notice), None)
        victim = victim or next((i for i in queue.items if i.kind == "shard"), None)
        if victim is None:
            return False
        queue.items.remove(victim)
        self._forget(queue, victim)
        queue.dropped += 1
        budget = "node" if node else "attempt"
        if queue.dropped == 1 or queue.dropped % 1000 == 0:
            limits = (self.node_max_items, self.node_max_bytes) if node else (self.max_items, self.max_bytes)
            log.warning("outbox_full_dropped_oldest", attempt_id=attempt_id, kind=victim.kind, budget=budget,
                        dropped=queue.dropped, max_items=limits[0], max_bytes=limits[1])
        if victim.waiter is not None:
            detail = ("dropped: the node's outbox is full and this attempt holds the most of it" if node
                      else "dropped: the agent's outbox is full")
            victim.waiter.resolve(HTTPStatus.SERVICE_UNAVAILABLE, {"detail": detail, "budget": budget})
        if queue.notice is None:
            why = ("the agent's outbox for this node was full and this attempt held the most of it" if node
                   else "the agent's outbox for this attempt was full")
            notice = WorkerEvent(rank=victim.body.rank, kind=DROPPED_EVENT, at=datetime.now(UTC),
                                 message=f"{why}; the oldest items were dropped",
                                 data={"events": 0, "shards": 0, "bytes": 0})
            self._seq += 1
            queue.notice = _Item(self._seq, "event", notice, None, len(notice.model_dump_json()), notice=True)
            self._add(queue, queue.notice)
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
                self._forget(queue, queue.items.popleft())
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
            if queue is not None:
                self._items -= len(queue.items)
                self._bytes -= queue.size
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
