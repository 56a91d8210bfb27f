"""Relay of checkpoint shards and worker events from the local API to the control plane.

Workers post a shard (after uploading it) or an event to the local API; it is queued here at once
and the worker gets its answer without waiting on the control plane. The relay loop sends each
attempt's queue in order, in batches of consecutive items of one kind (ShardReport,
WorkerEventBatch), so order is kept across both kinds. Delivery is at least once: an item leaves
its queue only when the control plane acknowledged the batch holding it (shards are keyed by
(attempt, step, rank) there, so a resent one is stored once). While the control plane is
unreachable, items wait in memory, at most `max_items` and `max_bytes` (their JSON) per attempt
and a budget of both for the whole node (node_agent/link/outbox.py), and the relay backs off. Past a
bound the oldest event goes first (events inform; shards commit checkpoints), then the oldest
shard, of the attempt itself, or for the node's budget of the attempt holding the most of it; an
`agent.outbox_dropped` event (the job's events show it as worker.agent.outbox_dropped), queued in
its place and updated while it waits, tells the control plane how many of each kind were dropped.

Answers that resending cannot change: a fencing 409 (stale attempt) drops the attempt's queue and
the agent stops the attempt; any other 4xx drops the offending items (a rejected batch of several
is resent one item at a time, so that one bad shard does not take the other ranks' with it).

A worker may wait for its shard's batch to be acknowledged (`?wait=1`): it then learns from the
ShardAck whether its step is committed. See two-phase checkpoints in docs/architecture.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from http import HTTPStatus

import structlog

from node_agent.link.client import (
    ControlPlaneClient,
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from node_agent.link.outbox import Batch, Outbox
from trainyard.protocol.agent import ShardInfo, ShardReport, WorkerEvent, WorkerEventBatch

log = structlog.get_logger(__name__)

_IDLE_S = 1.0


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
            if exc.retry_after_s:  # a busy replica said when (its bookkeeping gate): then, with jitter
                return exc.retry_after_s * random.uniform(1.0, 1.5)
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
