"""Report training progress and the final result to the node agent's local API.

Endpoints and bodies are the worker <-> agent part of the wire contract
(``trainyard/protocol/agent.py``: LocalProgress, LocalResult). The two reports are treated
differently on purpose:

- progress is advisory: it is sent from a background thread, at most every ``min_interval_s``
  (the latest value wins), with a short timeout, and every failure is logged and swallowed. A
  slow, dead or restarting agent must never slow or crash training.
- the result is the outcome of the whole attempt: it is sent synchronously and retried with
  backoff, and failing to deliver it raises. The agent must treat a repeated identical result as
  one (a retry may follow a response that was lost, not a request).

Every rank reports: global rank 0 its loss and metrics (the attempt's progress), the others their
step and timings only. Those feed the agent's per-node summary of its ranks (the watchdogs: a rank
that stops reporting is named when its attempt hangs; one much slower than its peers is named a
straggler). So that a rank blocked in a collective still counts as alive, the sender thread resends
the latest report every ``keepalive_s``: only a stopped or frozen process falls silent.

A 409 means the agent no longer considers this attempt current (it was superseded or stopped;
see fencing in docs/architecture.md): progress stops being sent and ``result`` raises
:class:`StaleAttemptError`, whose right handling is to exit without writing anything more.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote

import httpx

from trainyard.protocol.agent import REPORT_KEEPALIVE_S
from trainyard.protocol.env import LOCAL_API_PREFIX
from worker_runtime.agent_http import agent_client
from worker_runtime.context import WorkerContext

log = logging.getLogger(__name__)


class ReportError(RuntimeError):
    """The agent did not accept a report."""


class StaleAttemptError(ReportError):
    """The agent answered 409: this attempt is no longer the job's current attempt."""


class Reporter:
    """Sends this worker's progress and result to its agent; prints them when run standalone.

    Call it on every rank (SPMD). Global rank 0's reports carry loss and metrics, the other ranks'
    only their step and timings (all of them with ``all_ranks``); only rank 0 sends the result. Use
    it as a context manager, or call :meth:`close`, so the last progress is delivered. Time the
    part of a step a rank computes on its own with :meth:`timed` (or :meth:`add_busy`): that is
    what tells a slow rank from the ranks that wait for it in collectives.
    """

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        min_interval_s: float = 0.5,
        progress_timeout_s: float = 2.0,
        result_timeout_s: float = 10.0,
        result_tries: int = 5,
        retry_backoff_s: float = 0.5,
        all_ranks: bool = False,
        echo: bool = True,
        keepalive_s: float = REPORT_KEEPALIVE_S,
        total_steps: int | None = None,
    ) -> None:
        """``total_steps``: the steps the script will run, sent with every progress report (the
        control plane shows step of total and an ETA)."""
        if min_interval_s < 0 or result_tries < 1:
            raise ValueError("min_interval_s must be >= 0 and result_tries >= 1")
        self._ctx = ctx
        self._enabled = True  # every rank: the agent's RankSummary
        self._metrics_rank = all_ranks or ctx.rank == 0
        self._keepalive = keepalive_s
        self._last_step: tuple[int, float] | None = None
        self._busy = 0.0
        self._echo = echo
        self.total_steps = total_steps
        self._interval = min_interval_s
        self._progress_timeout = progress_timeout_s
        self._result_timeout = result_timeout_s
        self._result_tries = result_tries
        self._backoff = retry_backoff_s
        self._base = None
        if ctx.agent_url is not None:
            self._base = f"{ctx.agent_url}{LOCAL_API_PREFIX}/attempts/{quote(ctx.attempt_id, safe='')}"
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._in_flight = False
        self._flushing = 0
        self._closing = False
        self._closed = False
        self._next_send_at = 0.0
        self._failures = 0
        self._stale = False
        self._thread: threading.Thread | None = None
        self._sent: dict[str, Any] | None = None
        self._client: httpx.Client | None = None  # used by the sender thread only
        self.sent_progress = 0
        """How many progress reports the agent accepted (for tests and diagnostics)."""

    @property
    def stale(self) -> bool:
        """True once the agent has answered 409; the loop may stop early."""
        return self._stale

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add_busy(self, seconds: float) -> None:
        """Count ``seconds`` this rank computed alone (outside collectives) since the last report."""
        if seconds > 0:
            self._busy += seconds

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Time a block this rank computes alone (its forward pass, say) as busy time."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add_busy(time.perf_counter() - started)

    def progress(self, step: int, loss: float | None = None, **metrics: float) -> None:
        """Record progress at ``step``; cheap, never blocks on the network, never raises."""
        if not self._enabled or self._stale or self._closing:
            return
        step, at = int(step), time.monotonic()
        step_time = busy = None
        if self._last_step is not None and step > self._last_step[0]:
            done = step - self._last_step[0]
            step_time = (at - self._last_step[1]) / done
            busy = self._busy / done if self._busy > 0 else None
        if self._last_step is None or step > self._last_step[0]:
            self._last_step, self._busy = (step, at), 0.0
        body: dict[str, Any] = {
            "fencing_token": self._ctx.fencing_token,
            "rank": self._ctx.rank,
            "step": step,
            "loss": _finite(loss) if self._metrics_rank else None,
            "metrics": {k: f for k, v in metrics.items() if (f := _finite(v)) is not None}
            if self._metrics_rank else {},
            "step_time_s": step_time,
            "busy_s": busy,
        }
        if self.total_steps is not None:
            body["total_steps"] = int(self.total_steps)
        with self._cond:
            self._pending = body
            if self._thread is None:
                target = self._echo_loop if self._base is None else self._send_loop
                self._thread = threading.Thread(target=target, name="trainyard-progress", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Send the latest progress now, bypassing the rate limit; False if it did not finish."""
        with self._cond:
            if self._thread is None:
                return True
            self._flushing += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: self._pending is None and not self._in_flight, timeout)
            finally:
                self._flushing -= 1

    def result(self, result: Mapping[str, Any]) -> None:
        """Deliver the attempt's result (rank 0's job), retrying; raise if it cannot be delivered.

        Raises StaleAttemptError on 409 and ReportError when every try failed or the agent
        rejected the body. Non-finite floats are sent as null (JSON has no NaN).
        """
        if not self._metrics_rank:
            return
        payload = _jsonable(dict(result))
        json.dumps(payload)  # a programming error (unserialisable value) fails here, not on the wire
        self.flush()
        if self._base is None:
            if self._echo:
                print(f"[trainyard] result {json.dumps(payload, sort_keys=True)}", file=sys.stderr)
            return
        body = {"fencing_token": self._ctx.fencing_token, "rank": self._ctx.rank, "result": payload}
        last = "no try made"
        with agent_client(self._ctx, self._result_timeout) as client:
            for attempt in range(1, self._result_tries + 1):
                try:
                    response = client.post(f"{self._base}/result", json=body)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if response.is_success:
                        return
                    if response.status_code == 409:
                        self._stale = True
                        raise StaleAttemptError(
                            f"agent rejected the result of attempt {self._ctx.attempt_id}: "
                            f"stale attempt (409) {response.text[:200]}"
                        )
                    last = f"HTTP {response.status_code} {response.text[:200]}"
                    # Other client errors are our bug or a contract mismatch: retrying cannot help.
                    if response.status_code < 500 and response.status_code not in (408, 429):
                        raise ReportError(f"agent rejected the result: {last}")
                if attempt < self._result_tries:
                    delay = self._backoff * 2 ** (attempt - 1)
                    log.warning("result not delivered (%s); try %d again in %.1fs", last, attempt + 1, delay)
                    time.sleep(delay)
        raise ReportError(f"result not delivered after {self._result_tries} tries: {last}")

    def close(self, timeout: float = 5.0) -> None:
        """Flush the last progress and stop the sender thread; idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if self._client is not None:
            self._client.close()
        self._closed = True

    # --- sender thread ---

    def _next_body(self, keepalive: bool = False) -> dict[str, Any] | None:
        """Wait (holding the lock) for a body that may be sent now; None means stop. With
        ``keepalive``, the last body sent is sent again after ``keepalive_s`` without a new one."""
        while self._pending is None and not self._closing:
            if keepalive and self._sent is not None and not self._stale:
                remaining = self._next_send_at + self._keepalive - time.monotonic()
                if remaining <= 0:
                    self._pending = self._sent
                    break
                self._cond.wait(remaining)
            else:
                self._cond.wait()
        if self._pending is None:
            return None
        while not (self._flushing or self._closing):
            remaining = self._next_send_at - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)
        body, self._pending = self._pending, None
        self._in_flight = True
        return body

    def _send_loop(self) -> None:
        self._client = agent_client(self._ctx, self._progress_timeout)
        while True:
            with self._cond:
                body = self._next_body(keepalive=True)
            if body is None:
                return
            ok = False
            try:
                ok = self._post_progress(body)
            except Exception:  # never let the thread die: later progress must still go out
                log.exception("unexpected error while reporting progress")
            with self._cond:
                self._in_flight = False
                self._sent = body
                self._failures = 0 if ok else self._failures + 1
                # Back off while the agent is unreachable, so a dead agent costs nothing.
                delay = self._interval * (2 ** min(self._failures, 6))
                self._next_send_at = time.monotonic() + min(delay, 30.0)
                if self._stale:
                    self._pending = None
                self._cond.notify_all()

    def _post_progress(self, body: dict[str, Any]) -> bool:
        assert self._client is not None
        try:
            response = self._client.post(f"{self._base}/progress", json=body)
        except httpx.HTTPError as exc:
            self._log_failure(f"{type(exc).__name__}: {exc}")
            return False
        if response.is_success:
            if self._failures:
                log.info("agent reachable again after %d failed progress reports", self._failures)
            self.sent_progress += 1
            return True
        if response.status_code == 409:
            self._stale = True
            log.warning("attempt %s is stale (agent answered 409); progress reports stop", self._ctx.attempt_id)
            return True
        self._log_failure(f"HTTP {response.status_code} {response.text[:200]}")
        return False

    def _log_failure(self, why: str) -> None:
        # The first failure and then every 20th: enough to diagnose, not enough to flood the log.
        level = logging.WARNING if self._failures % 20 == 0 else logging.DEBUG
        log.log(level, "progress not delivered (%s); training continues", why)

    def _echo_loop(self) -> None:
        # Standalone: the same rate limit and flush semantics, printing instead of posting.
        while True:
            with self._cond:
                body = self._next_body()
            if body is None:
                return
            if self._echo and self._metrics_rank:
                extra = "".join(f" {k}={v:.6g}" for k, v in sorted(body["metrics"].items()))
                loss = "" if body["loss"] is None else f" loss={body['loss']:.6g}"
                total = f"/{body['total_steps']}" if body.get("total_steps") else ""
                print(f"[trainyard] step={body['step']}{total}{loss}{extra}", file=sys.stderr, flush=True)
            with self._cond:
                self._in_flight = False
                self._next_send_at = time.monotonic() + self._interval
                self._cond.notify_all()


def _finite(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):  # progress must not raise over a malformed metric
        return None
    return number if math.isfinite(number) else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value
