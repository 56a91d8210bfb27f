"""Typed client of the control plane's agent API (trainyard/protocol/agent.py).

Transient failures (no connection, timeouts, 5xx) are retried a few times with jittered
exponential backoff, then raised as ControlPlaneUnavailable; the agent's loops keep going and
try again on their next round, so an outage never stops workers. Answers that retrying cannot
change are raised at once: 401 Unauthorized (re-register), 409 StaleAttempt (fenced off), and
RequestRejected for any other 4xx.

The control plane also answers 409 for conflicts that are not about fencing (a shard that contradicts an
earlier one, say); StaleAttempt.fencing tells them apart by the problem type.
"""

from __future__ import annotations

import contextlib
import json
import queue
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO, TypeVar

import httpx
import structlog
from pydantic import BaseModel, ValidationError

from trainyard.protocol.agent import (
    AGENT_API_PREFIX,
    AttemptStatusAck,
    AttemptStatusReport,
    HeartbeatRequest,
    HeartbeatResponse,
    LogAck,
    LogBatch,
    RegisterRequest,
    RegisterResponse,
    ShardAck,
    ShardReport,
    WaitRequest,
    WaitResponse,
    WorkerEventAck,
    WorkerEventBatch,
)
from trainyard.protocol.grants import StorageBatchAnswer, StorageBatchRequest, StorageGrants, StorageRequest
from trainyard.protocol.uploads import (
    SlotAnswer,
    SlotBatchAnswer,
    SlotBatchRequest,
    SlotRelease,
    SlotReleased,
    SlotRequest,
)

log = structlog.get_logger(__name__)
R = TypeVar("R", bound=BaseModel)


class ControlPlaneError(Exception):
    """A call to the control plane failed."""

    def __init__(
        self, message: str | None = None, *, status: int | None = None, problem_type: str | None = None
    ) -> None:
        super().__init__(message or (self.__doc__ or "").strip())
        self.status = status
        self.problem_type = problem_type
        """The `type` of the problem+json answer, if there was one."""


class ControlPlaneUnavailable(ControlPlaneError):
    """The control plane could not be reached or failed (5xx), even after retries."""

    retry_after_s: float | None = None
    """What the last 503 said to wait (Retry-After), if it said: a busy replica's bookkeeping gate."""


RETRY_AFTER_MAX_S = 10.0
"""The longest Retry-After the client waits for between tries (a larger one is read as this)."""


def retry_after(resp: httpx.Response) -> float | None:
    """The seconds of a 503's Retry-After (delay-seconds only; an HTTP date is ignored)."""
    if resp.status_code != 503:
        return None
    try:
        seconds = float(resp.headers.get("retry-after", ""))
    except ValueError:
        return None
    return min(max(0.0, seconds), RETRY_AFTER_MAX_S) if seconds == seconds else None


class Unauthorized(ControlPlaneError):
    """The control plane does not accept our credential (401): register (again)."""


class StaleAttempt(ControlPlaneError):
    """The attempt is not the job's current attempt, or its fencing token is wrong (409)."""

    @property
    def fencing(self) -> bool:
        """False when the problem type names another kind of conflict than a stale attempt. An
        untyped 409 counts as fencing: stopping is the safe reading."""
        kind = self.problem_type
        return kind is None or kind == "about:blank" or kind.rstrip("/").endswith("/stale-attempt")


class StaleAgent(ControlPlaneUnavailable):
    """Another agent instance registered as this node (409 .../stale-agent): this agent must stop.

    A kind of ControlPlaneUnavailable so that every call site keeps what it was sending (nothing
    is dropped or marked stale on its account); the client tells the agent once, through
    ``on_stale_agent``, and the agent stops."""


def _is_stale_agent(problem_type: str | None) -> bool:
    return problem_type is not None and problem_type.rstrip("/").endswith("/stale-agent")


class TlsMismatch(ControlPlaneUnavailable):
    """The control plane's TLS does not match this agent's: its certificate is not signed by a CA the
    agent trusts, or one side speaks TLS and the other plain HTTP. Retrying cannot help; an
    operator must (the message says what)."""


def tls_problem(exc: httpx.TransportError, url: str) -> str | None:
    """One line saying what is wrong when ``exc`` is a TLS mismatch with the server at ``url``."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLCertVerificationError):
        return (f"the control plane at {url} presented a certificate this agent does not trust "
                f"({cause.verify_message or cause.reason}): give the CA that signed it with --ca-file")
    if isinstance(cause, ssl.SSLError) and cause.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE",
                                                             "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):
        return f"the server at {url} does not speak TLS ({cause.reason}): is it plain HTTP?"
    return None


def plain_http_hint(exc: httpx.TransportError, url: str) -> str:
    """What to add to a failure of a plain-HTTP request that may have met an HTTPS server, which
    hangs up without an answer: a clean close or a reset, depending on when its TLS layer gives up
    on the bytes (so might a server that is restarting: only a hint)."""
    if url.startswith("http://") and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return " (if the server serves HTTPS, use an https:// URL)"
    return ""


class RequestRejected(ControlPlaneError):
    """The control plane rejected the request (4xx other than 401/409); resending won't help."""


NO_BATCH_PATH = (404, 405)
"""What a control plane that predates a batch path answers it (RequestRejected.status)."""


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    attempts: int = 3
    """Tries per call, the first included."""
    initial_s: float = 0.2
    max_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.initial_s < 0 or self.max_s < self.initial_s:
            raise ValueError("invalid retry policy")

    def delay(self, retry: int) -> float:
        # Full jitter: agents that lost the control plane together must not return in lockstep.
        return random.uniform(0, min(self.max_s, self.initial_s * 2**retry))


class ControlPlaneClient:
    """Thread-safe: each thread gets its own connection pool, as httpx clients are not meant to be
    shared by concurrent threads; a slow status post then never delays a heartbeat."""

    def __init__(
        self,
        base_url: str,
        *,
        join_token: str,
        timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
        stop: threading.Event | None = None,
        ca_file: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Verified against ca_file, or the system's trust store (not a bundle shipped with httpx).
        self._tls = ssl.create_default_context(cafile=ca_file)
        self.join_token = join_token
        self.node_token: str | None = None
        self.timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))
        self.heartbeat_timeout = self.timeout
        self.retry = retry or RetryPolicy()
        self._stop = stop or threading.Event()
        self.on_stale_agent: Callable[[StaleAgent], None] | None = None
        """Called (on the calling thread) when the control plane says another instance took over."""
        self._local = threading.local()
        self._idle: queue.SimpleQueue[httpx.Client] = queue.SimpleQueue()
        """Clients for calls made on behalf of workers, from the local API's threads (one per
        connection, so a thread-local client each would pile up): borrowed, then put back."""
        self._clients: list[httpx.Client] = []
        self._lock = threading.Lock()
        self._closed = False

    def set_heartbeat_timeout(self, timeout_s: float) -> None:
        """The per-try timeout of later heartbeats: the agent derives it from what the control plane
        says at registration (trainyard/protocol/agent.py, agent_request_timeout_s), so a heartbeat and its
        retries are over before the node-lost timeout. Other requests keep ``timeout_s``: they are
        not liveness, and the outbox resends them."""
        self.heartbeat_timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))

    def _new_client(self) -> httpx.Client:
        with self._lock:
            if self._closed:
                raise ControlPlaneUnavailable("client closed")
            client = httpx.Client(base_url=self.base_url + AGENT_API_PREFIX, timeout=self.timeout, verify=self._tls)
            self._clients.append(client)
        return client

    @contextlib.contextmanager
    def _http(self, *, pooled: bool = False) -> Iterator[httpx.Client]:
        """This thread's client (the agent's loops), or one borrowed from the pool (``pooled``)."""
        if not pooled:
            client: httpx.Client | None = getattr(self._local, "client", None)
            if client is None:
                client = self._local.client = self._new_client()
            yield client
            return
        try:
            borrowed = self._idle.get_nowait()
        except queue.Empty:
            borrowed = self._new_client()
        try:
            yield borrowed
        finally:
            self._idle.put(borrowed)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def _post(self, path: str, body: BaseModel, response: type[R], *, token: str | None,
              timeout: httpx.Timeout | None = None, pooled: bool = False, liveness: bool = False) -> R:
        """``liveness``: a heartbeat or registration, which keeps its own short backoff (its tries
        must end within the node-lost timeout) even when a 503 says Retry-After; other requests wait
        at least what a 503 says before trying again."""
        if token is None:
            raise Unauthorized("not registered")
        node_call = token is not self.join_token
        try:
            # Encoded here, strictly: a value JSON cannot carry (NaN) is this request's problem,
            # raised as a rejection the caller drops, never an error that escapes its loop.
            content = json.dumps(body.model_dump(mode="json"), allow_nan=False).encode()
        except ValueError as exc:
            raise RequestRejected(f"cannot encode the request to {path}: {exc}", status=422) from exc
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        last: str = ""
        wait_at_least: float | None = None
        for attempt in range(self.retry.attempts):
            delay = self.retry.delay(attempt - 1) if attempt else 0.0
            if wait_at_least is not None and not liveness:
                # A busy replica said when: wait that, spread over half as much again, so the agents
                # it turned away together do not come back together.
                delay = max(delay, wait_at_least * random.uniform(1.0, 1.5))
            if attempt and self._stop.wait(delay):
                break  # shutting down: give up now rather than after the backoff
            try:
                with self._http(pooled=pooled) as http:
                    resp = http.post(path, content=content, headers=headers, timeout=timeout or self.timeout)
            except httpx.TransportError as exc:
                problem = tls_problem(exc, self.base_url)
                if problem is not None:
                    raise TlsMismatch(problem) from exc
                last = f"{type(exc).__name__}: {exc}{plain_http_hint(exc, self.base_url)}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                wait_at_least = retry_after(resp)
                continue
            wait_at_least = None
            if resp.status_code == 401:
                raise Unauthorized(_detail(resp), status=401)
            if resp.status_code == 409 and _is_stale_agent(_problem_type(resp)):
                if node_call and self.node_token is not None and self.node_token != token:
                    # This agent registered again while the request was out: send it again with the
                    # new credential (our own older registration is stale, not us).
                    token = self.node_token
                    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
                    last = "sent with this agent's previous credential"
                    continue
                stale = StaleAgent(_detail(resp), status=409, problem_type=_problem_type(resp))
                if self.on_stale_agent is not None:
                    self.on_stale_agent(stale)
                raise stale
            if resp.status_code == 409:
                raise StaleAttempt(_detail(resp), status=409, problem_type=_problem_type(resp))
            if resp.status_code >= 400:
                raise RequestRejected(f"HTTP {resp.status_code} on {path}: {_detail(resp)}", status=resp.status_code,
                                      problem_type=_problem_type(resp))
            try:
                return response.model_validate_json(resp.content)
            except ValidationError as exc:
                raise RequestRejected(f"unexpected response to {path}: {exc}", status=resp.status_code) from exc
        unavailable = ControlPlaneUnavailable(f"{path}: {last or 'stopped'}")
        unavailable.retry_after_s = wait_at_least
        raise unavailable

    def register(self, request: RegisterRequest, credential: str | None = None) -> RegisterResponse:
        """With the node's own ``credential`` when there is one (it re-claims its registered node);
        with the join token when there is none, or when the control plane does not know it (401)."""
        tokens = [t for t in (credential, self.join_token) if t]
        if not tokens:
            raise Unauthorized("neither a node credential nor a join token to register with")
        for i, token in enumerate(tokens):
            try:
                resp = self._post("/register", request, RegisterResponse, token=token, liveness=True)
            except Unauthorized:
                if i == len(tokens) - 1:
                    raise
                log.warning("node_credential_refused_trying_join_token")
                continue
            self.node_token = resp.node_token
            return resp
        raise AssertionError("unreachable")

    def heartbeat(self, request: HeartbeatRequest) -> HeartbeatResponse:
        return self._post("/heartbeat", request, HeartbeatResponse, token=self.node_token,
                          timeout=self.heartbeat_timeout, liveness=True)

    def wait(self, request: WaitRequest) -> WaitResponse:
        """The long poll: answered when the node's desired state changes, or after ``timeout_s``."""
        held = (request.timeout_s or 30.0) + 10.0
        return self._post("/wait", request, WaitResponse, token=self.node_token,
                          timeout=httpx.Timeout(held, connect=min(held, 3.0)))

    def report_status(self, attempt_id: str, report: AttemptStatusReport) -> AttemptStatusAck:
        return self._post(f"/attempts/{attempt_id}/status", report, AttemptStatusAck, token=self.node_token)

    def send_logs(self, attempt_id: str, batch: LogBatch) -> LogAck:
        return self._post(f"/attempts/{attempt_id}/logs", batch, LogAck, token=self.node_token)

    def report_shards(self, attempt_id: str, report: ShardReport) -> ShardAck:
        return self._post(f"/attempts/{attempt_id}/shards", report, ShardAck, token=self.node_token)

    def report_events(self, attempt_id: str, batch: WorkerEventBatch) -> WorkerEventAck:
        return self._post(f"/attempts/{attempt_id}/events", batch, WorkerEventAck, token=self.node_token)

    def fetch_code(self, attempt_id: str, out: BinaryIO, max_bytes: int, deadline: float) -> None:
        """Write the tar.gz of an attempt's shipped code into ``out`` (node_agent/part/code.py checks and
        caches it): streamed, at most ``max_bytes``, done by the ``deadline`` (time.monotonic()) or
        abandoned. Retried from the start on a transport error or a 5xx."""
        if self.node_token is None:
            raise Unauthorized("not registered")
        last = ""
        for attempt in range(self.retry.attempts):
            if attempt and self._stop.wait(self.retry.delay(attempt - 1)):
                break
            out.seek(0)
            out.truncate()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                with self._http(pooled=True) as http, http.stream(
                        "GET", f"/attempts/{attempt_id}/code", timeout=httpx.Timeout(min(left, 60.0), connect=3.0),
                        headers={"Authorization": f"Bearer {self.node_token}"}) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                    else:
                        _stream_into(resp, out, max_bytes, deadline)
                        return
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if resp.status_code >= 500:
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
                continue
            if resp.status_code == 409:
                raise StaleAttempt(_detail(resp), status=409, problem_type=_problem_type(resp))
            raise RequestRejected(f"HTTP {resp.status_code} fetching code: {_detail(resp)}", status=resp.status_code)
        raise ControlPlaneUnavailable(f"fetching code: {last or 'out of time'}")

    def storage_grants(self, attempt_id: str, request: StorageRequest) -> StorageGrants:
        """Presigned URLs for a worker's checkpoint objects (trainyard/protocol/grants.py)."""
        return self._post(f"/attempts/{attempt_id}/storage", request, StorageGrants, token=self.node_token,
                          pooled=True)  # called from the local API's threads

    def upload_slot(self, attempt_id: str, request: SlotRequest) -> SlotAnswer:
        """A checkpoint upload slot (a long poll of up to ``request.wait_s``)."""
        held = request.wait_s + 10.0
        return self._post(f"/attempts/{attempt_id}/upload-slots", request, SlotAnswer, token=self.node_token,
                          timeout=httpx.Timeout(held, connect=min(held, 3.0)),
                          pooled=True)  # called from the local API's threads, as storage_grants

    def release_upload_slot(self, attempt_id: str, request: SlotRelease) -> SlotReleased:
        return self._post(f"/attempts/{attempt_id}/upload-slots/release", request, SlotReleased,
                          token=self.node_token, pooled=True)

    def upload_slot_batch(self, attempt_id: str, request: SlotBatchRequest) -> SlotBatchAnswer:
        """Several ranks' upload-slot asks and releases (a long poll of up to ``request.wait_s``);
        RequestRejected with a status in NO_BATCH_PATH from a control plane that predates it."""
        held = request.wait_s + 10.0
        return self._post(f"/attempts/{attempt_id}/upload-slots/batch", request, SlotBatchAnswer,
                          token=self.node_token, timeout=httpx.Timeout(held, connect=min(held, 3.0)), pooled=True)

    def storage_grants_batch(self, attempt_id: str, request: StorageBatchRequest) -> StorageBatchAnswer:
        """Several workers' storage requests, each answered on its own (trainyard/protocol/grants.py);
        RequestRejected with a status in NO_BATCH_PATH from a control plane that predates it."""
        return self._post(f"/attempts/{attempt_id}/storage/batch", request, StorageBatchAnswer,
                          token=self.node_token, pooled=True)


def _stream_into(resp: httpx.Response, out: BinaryIO, max_bytes: int, deadline: float) -> None:
    """The body into ``out``: no more than ``max_bytes`` kept, no later than ``deadline``."""
    written = 0
    for chunk in resp.iter_bytes(1 << 20):
        written += len(chunk)
        if written > max_bytes:
            raise RequestRejected(f"the code archive sent is longer than the {max_bytes} bytes the control plane named")
        if time.monotonic() > deadline:
            raise ControlPlaneUnavailable(f"fetching code: not done by its deadline ({written} bytes in)")
        out.write(chunk)


def _detail(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or body)[:500]
    return str(body)[:500]


def _problem_type(resp: httpx.Response) -> str | None:
    try:
        body = resp.json()
    except ValueError:
        return None
    kind = body.get("type") if isinstance(body, dict) else None
    return kind if isinstance(kind, str) else None
