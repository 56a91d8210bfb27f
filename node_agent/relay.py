"""Relay of checkpoint shards and worker events from the local API to the control plane.

Workers post a shard (after uploading it) or an event to the local API; it is queued here at once
and the worker gets its answer without waiting on the control plane. The relay loop sends each
attempt's queue in order, in batches of consecutive items of one kind (ShardReport,
WorkerEventBatch), so order is kept across both kinds. Delivery is at least once: an item leaves
its queue only when the control plane acknowledged the batch holding it (shards are keyed by
(attempt, step, rank) there, so a resent one is stored once). While the control plane is
unreachable, items wait in memory, at most `max_items` and `max_bytes` (their JSON) per attempt,
and the relay backs off. Past either bound the oldest event goes first (events inform; shards
commit checkpoints), then the oldest shard; an `agent.outbox_dropped` event (the job's events show it
as worker.agent.outbox_dropped), queued in its place and updated while it waits, tells the control
plane how many of each kind were dropped.

Answers that resending cannot change: a fencing 409 (stale attempt) drops the attempt's queue and
the agent stops the attempt; any other 4xx drops the offending items (a rejected batch of several
is resent one item at a time, so that one bad shard does not take the other ranks' with it).

A worker may wait for its shard's batch to be acknowledged (`?wait=1`): it then learns from the
ShardAck whether its step is committed. See two-phase checkpoints in docs/architecture.md.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, Literal

import structlog

from node_agent.client import (
    ControlPlaneClient,
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from trainyard.protocol.agent import ShardInfo, ShardReport, WorkerEvent, WorkerEventBatch

log = structlog.get_logger(__name__)

Kind = Literal["shard", "event"]
MAX_ITEMS_PER_ATTEMPT = 10_000
MAX_BYTES_PER_ATTEMPT = 8 * 1024 * 1024
DROPPED_EVENT = "agent.outbox_dropped"
MAX_BATCH = 100
_IDLE_S = 1.0


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


class Relay:
    """Sends what the Outbox holds, attempt by attempt, oldest first (call `step` from one thread).

    `target(attempt_id)` gives the attempt's (fencing token, node rank), or None when the agent no
    longer runs it; `on_stale` is called on a fencing 409, `on_unauthorized` on a 401.
    """

    def __init__(
        self,
        outbox: Outbox,
        client: ControlPlaneClient,
        *,
        target: Callable[[str], tuple[str, int] | None],
        on_stale: Callable[[str, StaleAttempt], None],
        on_unauthorized: Callable[[], None],
        max_backoff_s: float = 5.0,
        batches_per_round: int = 8,
    ) -> None:
        self.outbox = outbox
        self.client = client
        self._target = target
        self._on_stale = on_stale
        self._on_unauthorized = on_unauthorized
        self.max_backoff_s = max_backoff_s
        self.batches_per_round = batches_per_round
        self._failures: dict[str, int] = {}
        self._next_try_at: dict[str, float] = {}
        self.failed_sends = 0
        """Sends that failed for a transient reason (for tests and diagnostics)."""

    def step(self) -> float:
        """Send what is due; return the seconds until something is due again."""
        wait = _IDLE_S
        attempt_ids = self.outbox.attempts()
        for attempt_id in attempt_ids:
            due_in = self._next_try_at.get(attempt_id, 0.0) - time.monotonic()
            if due_in <= 0:
                try:
                    due_in = self._send_attempt(attempt_id)
                except Exception:  # one attempt's trouble never holds up the others' items
                    log.exception("outbox_send_crashed", attempt_id=attempt_id)
                    due_in = self.max_backoff_s
                    self._next_try_at[attempt_id] = time.monotonic() + due_in
            wait = min(wait, max(0.0, due_in))
        for attempt_id in set(self._next_try_at) - set(attempt_ids):
            self._next_try_at.pop(attempt_id, None)
            self._failures.pop(attempt_id, None)
        return wait

    def _send_attempt(self, attempt_id: str) -> float:
        for _ in range(self.batches_per_round):  # bounded, so one chatty attempt starves no other
            batch = self.outbox.next_batch(attempt_id)
            if batch is None:
                return _IDLE_S
            retry_in = self._send(batch)
            if retry_in is not None:
                self._failures[attempt_id] = failures = self._failures.get(attempt_id, 0) + 1
                retry_in = retry_in or random.uniform(0.5, 1.0) * min(self.max_backoff_s, 0.25 * 2**failures)
                self._next_try_at[attempt_id] = time.monotonic() + retry_in
                return retry_in
            self._failures.pop(attempt_id, None)
        return 0.0

    def _send(self, batch: Batch) -> float | None:
        """Send one batch; None when it is settled, else when to try again (0: back off)."""
        attempt_id = batch.attempt_id
        target = self._target(attempt_id)
        if target is None:
            dropped = self.outbox.drop(attempt_id, HTTPStatus.CONFLICT, f"attempt {attempt_id} is not running here")
            log.warning("outbox_dropped_unknown_attempt", attempt_id=attempt_id, items=dropped)
            return None
        token, node_rank = target
        try:
            if batch.kind == "shard":
                shards = [item.body for item in batch.items if isinstance(item.body, ShardInfo)]
                report = ShardReport(fencing_token=token, node_rank=node_rank, shards=shards)
                ack = self.client.report_shards(attempt_id, report).model_dump(mode="json")
            else:
                events = [item.body for item in batch.items if isinstance(item.body, WorkerEvent)]
                body = WorkerEventBatch(fencing_token=token, node_rank=node_rank, events=events)
                ack = self.client.report_events(attempt_id, body).model_dump(mode="json")
        except StaleAttempt as exc:
            if exc.fencing:
                dropped = self.outbox.drop(attempt_id, HTTPStatus.CONFLICT, f"stale attempt: {exc}")
                log.warning("outbox_attempt_stale", attempt_id=attempt_id, kind=batch.kind, dropped=dropped)
                self._on_stale(attempt_id, exc)
                return None
            self._rejected(batch, exc)
            return None
        except Unauthorized:
            self._on_unauthorized()
            return 0.5
        except ControlPlaneUnavailable as exc:
            self.failed_sends += 1
            log.info("outbox_send_failed", attempt_id=attempt_id, kind=batch.kind, items=len(batch), error=str(exc))
            return 0.0
        except RequestRejected as exc:
            self._rejected(batch, exc)
            return None
        self.outbox.settle(batch, HTTPStatus.OK, ack)
        return None

    def _rejected(self, batch: Batch, exc: StaleAttempt | RequestRejected) -> None:
        if len(batch) > 1:
            # Find the offending items: resend these one by one, dropping only those refused again.
            log.warning("outbox_batch_rejected_resending_singly", attempt_id=batch.attempt_id,
                        kind=batch.kind, items=len(batch), error=str(exc))
            self.outbox.send_singly(batch)
            return
        log.error("outbox_item_dropped", attempt_id=batch.attempt_id, kind=batch.kind, error=str(exc))
        detail = f"the control plane refused this {batch.kind} (HTTP {exc.status}): {exc}"
        # 422, not the upstream status: a worker must not read a refused shard as "fenced off".
        self.outbox.settle(batch, HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": detail, "upstream_status": exc.status})
