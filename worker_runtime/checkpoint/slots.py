"""Wait for a checkpoint upload slot before uploading a shard (docs/architecture.md, "Checkpoint
upload slots"); the messages are trainyard/protocol/uploads.py.

The wait happens where the upload happens, in the checkpoint manager's background thread, so the
training loop never waits for a slot: it only ever waits, as before, for the previous save when
the next one is due, and then that save stops waiting (``hurry``) and uploads at once, unpaced.
Waiting is a long poll through the worker's agent, asked again as each one ends. The wait is
bounded: a worker uploads without a slot (``bypassed``, with a ``checkpoint.upload_unslotted``
event saying why) when

- it has waited ``max_wait_s`` (the control plane's upload_slot_max_wait_s, or this side's bound);
- the next save is due, or the worker is leaving (``hurry``: CheckpointManager.close gave up waiting);
- the slot service cannot be reached for ``unreachable_s`` (agent down, control plane down), or it
  refuses the request for a reason other than fencing.

A stale attempt (409) gets no slot and uploads nothing. Without an agent (a script run by hand), or
with an agent that predates slots (404), there is no slot service: the upload goes ahead (``none``).
A granted slot is renewed every third of its lease while the upload runs (``keep``): a renewal
brings the node's current share of its byte budget, which the upload's pacer follows.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.uploads import SLOT_WAIT_MAX_S, SlotUse
from trainyard.storage.pacing import Pacer
from worker_runtime.agent_http import agent_client
from worker_runtime.context import WorkerContext

log = logging.getLogger(__name__)

RELEASE_TRIES = 4
"""Tries of a slot release that the agent answers 503 (or cannot be reached): about 6 s at most."""
RELEASE_RETRY_MAX_S = 2.0
"""The longest wait between two of them, whatever Retry-After says."""


@dataclass(frozen=True, kw_only=True)
class SlotGrant:
    """How waiting for a slot ended."""

    use: SlotUse
    wait_s: float
    slot_id: str | None = None
    rate_bytes_per_s: int | None = None
    ttl_s: float = 0.0
    reason: str | None = None
    """Why there is no slot (``bypassed`` or ``none``)."""
    stale: bool = False
    """The attempt is stale: upload nothing."""


class UploadSlots:
    """This rank's upload slots, asked of its agent's local API; thread-safe, never raises."""

    def __init__(self, ctx: WorkerContext, *, poll_s: float = 20.0, max_wait_s: float | None = None,
                 unreachable_s: float = 30.0, timeout_s: float = 5.0) -> None:
        self._ctx = ctx
        self.poll_s = min(max(0.1, poll_s), SLOT_WAIT_MAX_S)
        self.max_wait_s = max_wait_s
        self.unreachable_s = unreachable_s
        self._timeout = timeout_s
        self._base = None
        if ctx.agent_url is not None:
            self._base = f"{ctx.agent_url}{LOCAL_API_PREFIX}/attempts/{quote(ctx.attempt_id, safe='')}"

    def _post(self, kind: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
        """(status, JSON body); status 0 when the agent could not be reached."""
        assert self._base is not None
        try:
            with agent_client(self._ctx, timeout) as client:
                response = client.post(f"{self._base}/{kind}", json=body)
        except httpx.HTTPError as exc:
            return 0, {"detail": f"{type(exc).__name__}: {exc}"}
        try:
            payload = response.json()
        except ValueError:
            payload = {"detail": response.text[:200]}
        return response.status_code, payload if isinstance(payload, dict) else {}

    def _ask_body(self, step: int, size: int, wait_s: float) -> dict[str, Any]:
        return {"fencing_token": self._ctx.fencing_token, "rank": self._ctx.rank, "step": step,
                "size_bytes": size, "wait_s": round(wait_s, 3)}

    def acquire(self, step: int, size_bytes: int, *, hurry: threading.Event) -> SlotGrant:
        """Wait for the slot of this rank's shard of ``step`` (see the module's docstring)."""
        started = time.monotonic()
        if self._base is None:
            return SlotGrant(use="none", wait_s=0.0, reason="no agent")
        bound = self.max_wait_s
        unreachable_since: float | None = None
        position = None
        while True:
            waited = time.monotonic() - started
            if bound is not None and waited >= bound:
                return self._bypass(step, started, f"waited {waited:.1f}s for an upload slot, the bound "
                                    f"(queue position {position})")
            wait_s = self.poll_s if bound is None else max(0.0, min(self.poll_s, bound - waited))
            call = _Call(self, self._ask_body(step, size_bytes, wait_s), wait_s + 15.0)
            # The poll runs in a helper thread: a due save ends the wait at once, not when the poll ends.
            while not call.done.wait(0.05):
                if hurry.is_set():
                    return self._bypass(step, started, _hurried(time.monotonic() - started, position), after=call)
            status, body = call.result
            retry = 0.0
            if status == 200 and body.get("state") in ("granted", "waiting"):
                unreachable_since = None
                told = body.get("max_wait_s")
                if isinstance(told, int | float) and told > 0:
                    bound = told if bound is None else min(bound, told)
                if body["state"] == "granted":
                    return SlotGrant(use="granted", wait_s=time.monotonic() - started, slot_id=body.get("slot_id"),
                                     rate_bytes_per_s=body.get("rate_bytes_per_s"), ttl_s=float(body["ttl_s"]))
                position = body.get("position")
                retry = float(body.get("retry_after_s") or 0.0)
            elif status == 404:
                return SlotGrant(use="none", wait_s=time.monotonic() - started,
                                 reason="the agent relays no upload slots")
            elif status == 409:
                log.warning("no upload slot for step %d: the attempt is stale (409)", step)
                return SlotGrant(use="none", wait_s=time.monotonic() - started, stale=True, reason="stale attempt")
            elif status in (0, 408, 429) or status >= 500:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since >= self.unreachable_s:
                    return self._bypass(step, started, f"the slot service was unreachable for "
                                        f"{time.monotonic() - unreachable_since:.1f}s: {body.get('detail')}")
                retry = float(body.get("retry_after_s") or 1.0)
            else:
                return self._bypass(step, started, f"the slot request was refused (HTTP {status}): "
                                    f"{body.get('detail')}")
            if retry > 0 and hurry.wait(retry):
                return self._bypass(step, started, _hurried(time.monotonic() - started, position))

    def _bypass(self, step: int, started: float, reason: str, *, after: _Call | None = None) -> SlotGrant:
        log.warning("checkpoint of step %d uploads without a slot: %s", step, reason)
        # Give the queue place back (or the slot, had it just been granted) without delaying the upload;
        # after the poll in flight, if any, has been answered, so that it cannot open the place again.
        threading.Thread(target=self._withdraw, args=(step, after), daemon=True,
                         name="trainyard-upload-slot-withdraw").start()
        return SlotGrant(use="bypassed", wait_s=time.monotonic() - started, reason=reason)

    def _withdraw(self, step: int, after: _Call | None) -> None:
        if after is not None:
            after.done.wait(after.timeout)
        self.release(step, ok=False)

    def release(self, step: int, *, ok: bool, uploaded_bytes: int = 0, upload_s: float = 0.0) -> bool:
        """Give the slot of ``step`` back (or the queue place); True if the agent took it."""
        if self._base is None:
            return False
        body = {"fencing_token": self._ctx.fencing_token, "rank": self._ctx.rank, "step": step, "ok": ok,
                "uploaded_bytes": uploaded_bytes, "upload_s": round(max(0.0, upload_s), 6)}
        for attempt in range(RELEASE_TRIES):
            status, answer = self._post("upload-slot/release", body, self._timeout)
            if status == 200:
                return True
            if status not in (0, 503) or attempt == RELEASE_TRIES - 1:
                log.info("upload slot of step %d not released (HTTP %d %s); its lease will expire",
                         step, status, answer.get("detail"))
                return False
            # A busy control plane says when (its bookkeeping gate's Retry-After, relayed): a release
            # given up early holds the slot from the other ranks until its lease expires.
            time.sleep(min(RELEASE_RETRY_MAX_S, max(0.2, float(answer.get("retry_after_s") or 0.0))))
        return False

    def keep(self, step: int, size_bytes: int, grant: SlotGrant, pacer: Pacer) -> _Renewal:
        """Renew a granted slot every third of its lease until the returned renewal is stopped,
        passing each renewal's rate to ``pacer``."""
        return _Renewal(self, step, size_bytes, grant, pacer)


def _hurried(waited: float, position: Any) -> str:
    return (f"the worker needed the upload now (next save due, or leaving) after {waited:.1f}s of waiting "
            f"(queue position {position})")


class _Call:
    """One request to the agent, on a daemon thread of its own (never joined: a process that ends
    does not wait for a long poll)."""

    def __init__(self, slots: UploadSlots, body: dict[str, Any], timeout: float) -> None:
        self.timeout = timeout
        self.done = threading.Event()
        self.result: tuple[int, dict[str, Any]] = (0, {"detail": "no answer"})

        def run() -> None:
            try:
                self.result = slots._post("upload-slot", body, timeout)
            finally:
                self.done.set()

        threading.Thread(target=run, daemon=True, name="trainyard-upload-slot-poll").start()


class _Renewal:
    def __init__(self, slots: UploadSlots, step: int, size: int, grant: SlotGrant, pacer: Pacer) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if grant.use == "granted" and slots._base is not None:
            self._thread = threading.Thread(target=self._run, args=(slots, step, size, grant, pacer), daemon=True,
                                            name="trainyard-upload-slot-renew")
            self._thread.start()

    def _run(self, slots: UploadSlots, step: int, size: int, grant: SlotGrant, pacer: Pacer) -> None:
        every = max(0.5, grant.ttl_s / 3)
        while not self._stop.wait(every):
            status, body = slots._post("upload-slot", slots._ask_body(step, size, 0.0), slots._timeout)
            if status == 200 and body.get("state") == "granted":
                pacer.set_rate(body.get("rate_bytes_per_s"))
                every = max(0.5, float(body.get("ttl_s") or grant.ttl_s) / 3)
            elif status == 409:
                return  # stale: the shard report will be refused; nothing to renew
            # else: keep trying; should the lease lapse, the control plane reclaims it and we finish anyway

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
