"""Relay of the workers' checkpoint upload-slot requests to the control plane
(trainyard/protocol/uploads.py; docs/architecture.md, "Checkpoint upload slots").

Unlike shards and events (relay.py: queued, answered at once, sent later), a slot request is the
worker's question, so it is relayed as it comes, on the local API's request thread, and answered
with the control plane's answer: a granted slot, or the queue position after a long poll. The agent
adds what only it knows (the attempt's fencing token as the control plane issued it, its node rank)
after checking the worker's token (local/api.py).

The requests of the node's ranks that come together are relayed together (batcher.py): one
``upload-slots/batch`` request for the asks gathered within a few milliseconds (a long poll,
answered once any of them is granted: an ask still waiting is answered ``waiting`` and its worker
asks again at once, as after any long poll), another for the releases, which never wait behind a
long poll. Long polls and asks that must not wait (a renewal) are gathered apart, so a renewal never
shortens another rank's poll. A control plane that answers the batch path 404 or 405 predates it:
from then on this relay sends each request on its own (the single paths). What the worker gets,
batched or not:

- 200 and the SlotAnswer / SlotReleased;
- 409 when the control plane says the attempt is stale (the agent then stops it, as for a refused
  shard): no slot, no upload;
- 422 when the control plane refused the request for another reason;
- 503 with ``Retry-After`` when the control plane cannot be reached (the worker retries, and uploads
  without a slot once its bounded wait is over).

A release is the exception: the worker has nothing to wait for, and a release lost to a busy control
plane (its bookkeeping gate's 503) would hold the slot from every other rank until its lease expires.
So a release answered 503 is held here (``held: true`` to the worker, at once) and resent by a thread
of its own (never the relay loop's: shard reports must not wait behind it), an attempt's held ones
together, after the Retry-After, until the control plane takes it, refuses it, the attempt no longer
runs here (a stale answer to a resend is only dropped: the attempt's slots are reclaimed with it), the
rank asks for that slot again (the ask renews it), or ``RELEASE_HOLD_S`` passed.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import structlog

from node_agent.link.batcher import MAX_ITEMS, WINDOW_S, Coalescer
from node_agent.link.client import (
    NO_BATCH_PATH,
    ControlPlaneClient,
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    Unauthorized,
)
from trainyard.protocol.uploads import (
    LocalSlotRelease,
    LocalSlotReleased,
    LocalSlotRequest,
    SlotAsk,
    SlotBatchRequest,
    SlotRelease,
    SlotReleased,
    SlotReleaseItem,
    SlotRequest,
)

log = structlog.get_logger(__name__)

UNAVAILABLE_RETRY_S = 2.0
"""What a 503 tells the worker to wait before it asks again."""
RELEASE_HOLD_S = 600.0
"""How long a release answered 503 is resent: longer than a slot's lease at usual settings (30 s by
default); a release that outlives its lease is answered ``released: false``, harmlessly."""
RELEASE_RESEND_MAX_S = 5.0
"""The longest wait between two resends, whatever Retry-After says."""
RELEASES_HELD_MAX = 65_536
"""Releases held at once on this node; past it a release answered 503 is answered 503 (the worker
retries)."""
RELEASES_HELD_PER_ATTEMPT = MAX_ITEMS
"""Releases one attempt may have held: a part's workers (another tenant's code) cannot take the
node's room from the parts beside it, however many releases they send while the control plane is busy."""

Answer = tuple[HTTPStatus, dict[str, Any]]


class SlotRelay:
    """``target(attempt_id)`` gives the attempt's (fencing token, node rank), or None when the agent
    no longer runs it; ``ranks(attempt_id)`` its ranks on this node (a batch of that many goes at
    once); ``on_stale`` is called on a fencing 409 (once per batch), ``on_unauthorized`` on a 401."""

    def __init__(
        self,
        client: ControlPlaneClient,
        *,
        target: Callable[[str], tuple[str, int] | None],
        on_stale: Callable[[str, StaleAttempt], None],
        on_unauthorized: Callable[[], None],
        ranks: Callable[[str], int] | None = None,
        window_s: float = WINDOW_S,
    ) -> None:
        self.client = client
        self._target = target
        self._on_stale = on_stale
        self._on_unauthorized = on_unauthorized
        self._ranks = ranks or (lambda attempt_id: 0)
        self.asks: Coalescer[tuple[str, bool], LocalSlotRequest, Answer | None] = Coalescer(
            self._send_asks, window_s=window_s)
        self.releases: Coalescer[str, LocalSlotRelease, Answer | None] = Coalescer(
            self._send_releases, window_s=window_s)
        self.batching = True
        """False once the control plane answered the batch path 404 or 405 (it predates batches)."""
        self._held: list[_Held] = []
        self._held_lock = threading.Lock()
        self._resender: threading.Thread | None = None
        self._closed = threading.Event()
        self.resent = 0
        """Held releases resent so far (diagnostics and tests)."""

    def ask(self, attempt_id: str, body: LocalSlotRequest) -> Answer:
        with self._held_lock:  # asked again: the ask renews the slot a held release would end
            self._held = [h for h in self._held
                          if (h.attempt_id, h.body.rank, h.body.step) != (attempt_id, body.rank, body.step)]
        if self.batching:
            answer = self.asks.submit((attempt_id, body.wait_s > 0), body, full_at=self._ranks(attempt_id))
            if answer is not None:
                return answer

        def send(token: str, node_rank: int) -> dict[str, Any]:
            request = SlotRequest(**body.model_dump(exclude={"fencing_token"}), fencing_token=token,
                                  node_rank=node_rank)
            return self.client.upload_slot(attempt_id, request).model_dump(mode="json")
        return self._relay(attempt_id, "upload_slot", send)

    def release(self, attempt_id: str, body: LocalSlotRelease) -> Answer:
        answer = None
        if self.batching:
            answer = self.releases.submit(attempt_id, body, full_at=self._ranks(attempt_id))
        if answer is None:
            answer = self._release_singly(attempt_id, body)
        if answer[0] == HTTPStatus.SERVICE_UNAVAILABLE and self._hold(
                [_Held(attempt_id, body, time.monotonic() + RELEASE_HOLD_S)], answer[1]):
            return HTTPStatus.OK, LocalSlotReleased(released=False, held=True).model_dump(mode="json")
        return answer

    def _release_singly(self, attempt_id: str, body: LocalSlotRelease, *, resend: bool = False) -> Answer:
        def send(token: str, node_rank: int) -> dict[str, Any]:
            request = SlotRelease(**body.model_dump(exclude={"fencing_token"}), fencing_token=token,
                                  node_rank=node_rank)
            return self.client.release_upload_slot(attempt_id, request).model_dump(mode="json")
        return self._relay(attempt_id, "upload_slot_release", send, fence=not resend)

    def _hold(self, held: list[_Held], answer: dict[str, Any]) -> bool:
        """Keep these releases to resend after the control plane's Retry-After; False when full or
        closed."""
        at = time.monotonic() + min(RELEASE_RESEND_MAX_S, max(0.2, float(answer.get("retry_after_s") or 0.0)))
        with self._held_lock:
            attempts = {h.attempt_id for h in held}
            mine = sum(1 for h in self._held if h.attempt_id in attempts)
            if (self._closed.is_set() or len(self._held) + len(held) > RELEASES_HELD_MAX
                    or mine + len(held) > RELEASES_HELD_PER_ATTEMPT):
                return False
            for h in held:
                h.next_at = at
            self._held += held
            if self._resender is None:
                self._resender = threading.Thread(target=self._resend_loop, name="agent-slot-release-resend",
                                                  daemon=True)
                self._resender.start()
        return True

    def _resend_loop(self) -> None:
        """Resend until nothing is held (the next hold starts another)."""
        while not self._closed.is_set():
            wait = self.resend_held()
            with self._held_lock:
                if not self._held:
                    self._resender = None
                    return
            self._closed.wait(wait)

    def close(self) -> None:
        """Stop resending (the agent is stopping); returns at once."""
        self._closed.set()

    def held(self) -> int:
        with self._held_lock:
            return len(self._held)

    def resend_held(self) -> float:
        """Resend the held releases that are due, an attempt's together (in batches of at most
        MAX_ITEMS); the seconds until the next is due. One caller at a time (the resend thread)."""
        now = time.monotonic()
        with self._held_lock:
            due = [h for h in self._held if h.next_at <= now]
            self._held = [h for h in self._held if h.next_at > now]
        by_attempt: dict[str, list[_Held]] = defaultdict(list)
        for h in due:
            by_attempt[h.attempt_id].append(h)
        for attempt_id, held in by_attempt.items():
            for chunk in range(0, len(held), MAX_ITEMS):
                self._resend(attempt_id, held[chunk:chunk + MAX_ITEMS])
        with self._held_lock:
            return max(0.0, min((h.next_at for h in self._held), default=now + 60.0) - time.monotonic())

    def _resend(self, attempt_id: str, held: list[_Held]) -> None:
        try:
            if self.batching:
                answers = self._send_releases(attempt_id, [h.body for h in held], resend=True)
            else:
                answers = [None] * len(held)
            results = [answer or self._release_singly(attempt_id, h.body, resend=True)
                       for h, answer in zip(held, answers, strict=True)]
        except Exception as exc:  # never lose them to a surprise: try again later
            log.warning("upload_slot_release_resend_failed", attempt_id=attempt_id, error=str(exc))
            results = [(HTTPStatus.SERVICE_UNAVAILABLE, {"retry_after_s": RELEASE_RESEND_MAX_S})] * len(held)
        again: list[_Held] = []
        for h, (status, payload) in zip(held, results, strict=True):
            self.resent += 1
            if status == HTTPStatus.SERVICE_UNAVAILABLE and time.monotonic() < h.give_up_at:
                again.append(h)
            elif status != HTTPStatus.OK:
                log.info("upload_slot_release_dropped", attempt_id=attempt_id, rank=h.body.rank,
                         step=h.body.step, status=int(status), detail=payload.get("detail"))
        if again:
            with self._held_lock:  # straight back: _hold would refuse them once closed or full
                at = time.monotonic() + RELEASE_RESEND_MAX_S
                for h in again:
                    h.next_at = at
                self._held += again

    def _send_asks(self, key: tuple[str, bool], items: Sequence[LocalSlotRequest]) -> list[Answer | None]:
        attempt_id, _long_poll = key

        def send(token: str, node_rank: int) -> list[dict[str, Any]]:
            request = SlotBatchRequest(
                fencing_token=token, node_rank=node_rank, wait_s=min(item.wait_s for item in items),
                asks=[SlotAsk(rank=item.rank, step=item.step, size_bytes=item.size_bytes) for item in items])
            answer = self.client.upload_slot_batch(attempt_id, request)
            if [(a.rank, a.step) for a in answer.answers] != [(a.rank, a.step) for a in request.asks]:
                raise RequestRejected("the control plane's batch answer does not match its asks")
            return [a.model_dump(mode="json", exclude={"rank", "step"}) for a in answer.answers]
        return self._relay_batch(attempt_id, "upload_slot_batch", len(items), send)

    def _send_releases(self, attempt_id: str, items: Sequence[LocalSlotRelease], *,
                       resend: bool = False) -> list[Answer | None]:
        def send(token: str, node_rank: int) -> list[dict[str, Any]]:
            request = SlotBatchRequest(
                fencing_token=token, node_rank=node_rank, wait_s=0,
                releases=[SlotReleaseItem(**item.model_dump(exclude={"fencing_token"})) for item in items])
            answer = self.client.upload_slot_batch(attempt_id, request)
            if len(answer.released) != len(items):
                raise RequestRejected("the control plane's batch answer does not match its releases")
            return [SlotReleased(released=released).model_dump(mode="json") for released in answer.released]
        return self._relay_batch(attempt_id, "upload_slot_release_batch", len(items), send, fence=not resend)

    def _relay_batch(self, attempt_id: str, what: str, n: int, send: Callable[[str, int], list[dict[str, Any]]],
                     *, fence: bool = True) -> list[Answer | None]:
        """Each item's answer; None for every item when the control plane has no batch path (each is
        then relayed on its own)."""
        answers: list[dict[str, Any]] = []

        def collect(token: str, node_rank: int) -> dict[str, Any]:
            answers.extend(send(token, node_rank))
            return {}
        try:
            status, payload = self._relay(attempt_id, what, collect, fallback=True, fence=fence)
        except _NoBatchPath:
            log.warning("upload_slot_batches_unsupported", detail="the control plane predates batch paths; "
                        "relaying each upload-slot request on its own")
            self.batching = False
            return [None] * n
        if status != HTTPStatus.OK:
            return [(status, payload)] * n
        return [(HTTPStatus.OK, answer) for answer in answers]

    def _relay(self, attempt_id: str, what: str, send: Callable[[str, int], dict[str, Any]], *,
               fallback: bool = False, fence: bool = True) -> Answer:
        """``fence``: a fencing 409 stops the attempt here (False for a resent release: a part
        parked for a handover answers stale, and its handover must not be cut short by it)."""
        target = self._target(attempt_id)
        if target is None:
            return HTTPStatus.CONFLICT, {"detail": f"attempt {attempt_id} is not running here"}
        try:
            return HTTPStatus.OK, send(*target)
        except StaleAttempt as exc:
            if exc.fencing:
                log.warning("upload_slot_stale_attempt", attempt_id=attempt_id, what=what)
                if fence:
                    self._on_stale(attempt_id, exc)
                return HTTPStatus.CONFLICT, {"detail": f"stale attempt: {exc}"}
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(exc), "upstream_status": exc.status}
        except Unauthorized:
            self._on_unauthorized()
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "the agent is registering again",
                                                    "retry_after_s": UNAVAILABLE_RETRY_S}
        except ControlPlaneUnavailable as exc:
            log.info("upload_slot_control_plane_unavailable", attempt_id=attempt_id, what=what, error=str(exc))
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": f"the control plane cannot be reached: {exc}",
                                                    "retry_after_s": max(UNAVAILABLE_RETRY_S,
                                                                         exc.retry_after_s or 0.0)}
        except RequestRejected as exc:
            if fallback and exc.status in NO_BATCH_PATH:
                raise _NoBatchPath from exc
            # 422, not the upstream status: a worker must not read a refusal as "fenced off".
            return HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": str(exc), "upstream_status": exc.status}


@dataclass
class _Held:
    """A release the control plane answered 503, resent from ``next_at`` until ``give_up_at``."""

    attempt_id: str
    body: LocalSlotRelease
    give_up_at: float
    next_at: float = 0.0


class _NoBatchPath(Exception):
    """The control plane answered a batch path 404 or 405: it predates batches."""
