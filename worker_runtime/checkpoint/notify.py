"""Tell the node agent about checkpoint shards and checkpoint events (every rank may send).

Bodies are the wire contract's LocalShard and LocalEvent (``trainyard/protocol/agent.py``):

- ``POST /v1/local/attempts/{id}/shards``  after a shard is in storage (phase 1 of the two-phase
  commit, docs/architecture.md). The agent queues it for the control plane and answers 202; with
  ``wait_ack`` it asks for ``?wait=1`` and gets the control plane's ShardAck.
- ``POST /v1/local/attempts/{id}/events``  checkpoint.restored / .fallback / .save_failed /
  .upload_unslotted.

Unlike the result, nothing here may stop training: a report that cannot be delivered after a few
short tries is logged and dropped (an undelivered shard leaves its checkpoint pending, and the
control plane aborts it). A 409 means the attempt is stale; later reports are not sent.
Standalone (no agent) the reports are only logged.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from trainyard.protocol.env import LOCAL_API_PREFIX
from worker_runtime.agent_http import agent_client
from worker_runtime.context import WorkerContext

log = logging.getLogger(__name__)

# Kinds the control plane turns into checkpoint facts (control_plane/services/checkpoints/checkpoints.py).
RESTORED = "checkpoint.restored"
FALLBACK = "checkpoint.fallback"
SAVE_FAILED = "checkpoint.save_failed"
SKIPPED = "checkpoint.skipped"
RESTORE_FAILED = "checkpoint.restore_failed"
UPLOAD_UNSLOTTED = "checkpoint.upload_unslotted"
"""A shard was uploaded without an upload slot (worker_runtime/checkpoint/slots.py says when)."""


class ShardSink(Protocol):
    """Where the checkpoint manager reports shards and events (a fake in tests)."""

    def shard(self, *, step: int, key: str, size_bytes: int, sha256: str,
              upload: dict[str, Any] | None = None,
              blocking_s: float | None = None, background_s: float | None = None) -> bool: ...

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> bool: ...


class CheckpointReporter:
    """Posts this rank's shards and events to its agent; thread-safe, never raises."""

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        timeout_s: float = 5.0,
        tries: int = 3,
        backoff_s: float = 0.25,
        wait_ack: bool = False,
        ack_timeout_s: float = 35.0,
    ) -> None:
        self._ctx = ctx
        self._timeout = timeout_s
        self._tries = max(1, tries)
        self._backoff = backoff_s
        self._wait_ack = wait_ack
        self._ack_timeout = ack_timeout_s
        self._base = None
        if ctx.agent_url is not None:
            self._base = f"{ctx.agent_url}{LOCAL_API_PREFIX}/attempts/{quote(ctx.attempt_id, safe='')}"
        self._lock = threading.Lock()
        self.stale = False
        """True once the agent answered 409 (this attempt is superseded)."""
        self.committed_steps: set[int] = set()
        """Steps the control plane said are committed (only with ``wait_ack``)."""

    def shard(self, *, step: int, key: str, size_bytes: int, sha256: str,
              upload: dict[str, Any] | None = None,
              blocking_s: float | None = None, background_s: float | None = None) -> bool:
        """Report an uploaded shard, with what the save cost (the loop blocked, then the background
        part) and with ``upload`` its slot wait and upload time (UploadStats); True if the agent took it."""
        body: dict[str, Any] = {
            "fencing_token": self._ctx.fencing_token,
            "rank": self._ctx.rank,
            "step": step,
            "world_size": self._ctx.world_size,
            "key": key,
            "size_bytes": size_bytes,
            "sha256": sha256,
            "blocking_s": None if blocking_s is None else round(blocking_s, 6),
            "background_s": None if background_s is None else round(background_s, 6),
        }
        if upload is not None:
            body["upload"] = upload
        if self._base is None:
            log.info("checkpoint shard step=%d rank=%d %s (%d bytes)", step, self._ctx.rank, key, size_bytes)
            return True
        # Waiting for the control plane takes longer than a plain post: the agent holds it up to
        # its shard_wait_s (30 s by default).
        suffix, timeout = ("?wait=1", self._ack_timeout) if self._wait_ack else ("", self._timeout)
        answer = self._post(f"shards{suffix}", body, timeout)
        if isinstance(answer, dict) and isinstance(answer.get("committed_steps"), list):
            with self._lock:
                self.committed_steps.update(int(s) for s in answer["committed_steps"])
        return answer is not None

    def checkpoint_interval(self) -> int | None:
        """The interval the platform chose for an 'auto' job, as the agent has it (None: none yet, or
        the agent could not be asked). One short try: a save must not wait on it."""
        if self._base is None or self.stale:
            return None
        try:
            with agent_client(self._ctx, min(self._timeout, 2.0)) as client:
                response = client.post(f"{self._base}/checkpoint-interval",
                                       json={"fencing_token": self._ctx.fencing_token})
        except httpx.HTTPError as exc:
            log.info("checkpoint interval not read from the agent (%s); keeping the current one", exc)
            return None
        if not response.is_success:
            return None
        steps = response.json().get("interval_steps") if response.headers.get("content-type", "").startswith(
            "application/json") else None
        return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1 else None

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> bool:
        """Report a checkpoint event; True if the agent took it."""
        body = {
            "fencing_token": self._ctx.fencing_token,
            "rank": self._ctx.rank,
            "kind": kind,
            "message": message[:4096],
            "data": dict(data or {}),
            "at": datetime.now(UTC).isoformat(),
        }
        if self._base is None:
            log.info("checkpoint event %s rank=%d: %s %s", kind, self._ctx.rank, message, body["data"])
            return True
        return self._post("events", body, self._timeout) is not None

    def _post(self, kind: str, body: dict[str, Any], timeout: float) -> dict[str, Any] | None:
        """The answer's JSON body ({} if none) on success; None when not delivered."""
        if self.stale:
            return None
        last = "no try made"
        with agent_client(self._ctx, timeout) as client:
            for attempt in range(1, self._tries + 1):
                try:
                    response = client.post(f"{self._base}/{kind}", json=body)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if response.is_success:
                        try:
                            answer = response.json()
                        except ValueError:
                            answer = {}
                        return answer if isinstance(answer, dict) else {}
                    if response.status_code == 409:
                        self.stale = True
                        log.warning("agent answered 409 (%s): attempt %s is stale", kind, self._ctx.attempt_id)
                        return None
                    if response.status_code == 504 and "wait=1" in kind:
                        # The control plane did not answer in time; the agent keeps the shard queued.
                        log.info("shard queued by the agent, not yet acknowledged by the control plane")
                        return {}
                    last = f"HTTP {response.status_code} {response.text[:200]}"
                    if response.status_code < 500 and response.status_code not in (408, 429):
                        break  # our bug or a contract mismatch: a retry cannot help
                if attempt < self._tries:
                    time.sleep(self._backoff * 2 ** (attempt - 1))
        log.warning("%s report not delivered (%s); training continues", kind.split("?")[0], last)
        return None
