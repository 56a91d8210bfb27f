"""The agent's HTTP API for its own workers: progress, results, checkpoint shards and events,
fenced by the attempt's token, served on one unix socket per attempt.

    POST /v1/local/attempts/{attempt_id}/progress   LocalProgress -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/result     LocalResult   -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/ready      LocalReady    -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/events     LocalEvent    -> 202 {"accepted": true, "queued": true}
    POST /v1/local/attempts/{attempt_id}/shards     LocalShard    -> 202 {"accepted": true, "queued": true}
    POST /v1/local/attempts/{attempt_id}/shards?wait=1            -> 200 ShardAck of the control plane
    POST /v1/local/attempts/{attempt_id}/upload-slot          LocalSlotRequest -> 200 SlotAnswer
    POST /v1/local/attempts/{attempt_id}/upload-slot/release  LocalSlotRelease -> 200 LocalSlotReleased
    POST /v1/local/attempts/{attempt_id}/checkpoint-interval  LocalCheckpointInterval
                                                      -> 200 {"interval_steps": N | null}
    POST /v1/local/attempts/{attempt_id}/storage          LocalStorageRequest -> 200 StorageGrants of the control plane

Each attempt part has its own socket (TRAINYARD_AGENT_SOCKET), owned by the attempt's uid with mode
0600 in a directory only the agent writes: no other attempt, and nothing off the node, can connect
to it, and it answers for its own attempt only (403 otherwise). An attempt unknown to the agent
(stale, or finished) or a wrong fencing token gets 409 problem+json: a worker of a superseded
attempt learns it is fenced off. Tokens are compared in constant time.

Bounded, so that one worker cannot take the API down for the others (LocalApiLimits): a body needs
a Content-Length of at most ``max_body`` bytes (411 without one, 400 when it is not a number, 413
above it); the request must arrive whole within ``request_timeout_s`` (the connection is closed
otherwise); one request per connection; at most ``connections_per_attempt`` connections of an
attempt and ``connections_total`` in all are served at once (503 beyond), each raised by
``connections_per_rank`` per rank of the part: a rank may hold two long waits (an upload-slot poll,
a shard's ?wait=1), and all ranks of a large part waiting together must not lock the part out. A number that is not
finite (NaN, Infinity, 1e999) anywhere in a body is refused with 422: JSON cannot carry it onward.

A rank says ``ready`` once its process group is initialised; when every rank of the part did, the
status report carries how long ago the last one did (``initialized_s_ago``: a recovery's rendezvous
phase ends there). The agent forwards progress and result in the attempt's next status report (every rank's step and
timings as the node's RankSummary, global rank 0's loss as the attempt's progress); shards and
events are queued for the relay (relay.py) and answered at once. The checkpoint interval is the one
the control plane last set for an 'auto' job (its status answer). With ?wait=1 a shard is answered once the
control plane acknowledged the batch holding it (so the worker learns from `committed_steps` whether
its step is committed): 409 if the control plane says the attempt is stale, 422 if it refused the
shard, 504 if no answer came within `shard_wait_s` (the shard stays queued), 503 if it was dropped.
Upload-slot requests are relayed to the control plane as they come (link/upload_slots.py), those of
the node's ranks that come together in one request (link/batcher.py); an agent built without a
relay answers them 404 (the worker then uploads without a slot).
A storage request (presigned URLs for checkpoint objects, trainyard/protocol/grants.py) is
forwarded to the control plane at once, gathered with the node's other ranks' the same way
(link/storage_grants.py), and answered with its own answer: the grants, or its refusal (403, 404,
409, 422); 503 when it cannot be reached.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import math
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

import structlog
from pydantic import ValidationError

from node_agent.link.outbox import Outbox
from node_agent.link.upload_slots import SlotRelay
from node_agent.local.connections import DeadlineReader, Gate, SocketWriter, refuse
from node_agent.local.handover import Handovers
from node_agent.memtier.local import MEMORY_ROUTE, serve_memory
from node_agent.memtier.tier import AttemptMemory, MemoryTier
from trainyard.protocol.agent import (
    MAX_NODE_RANKS,
    LocalCheckpointInterval,
    LocalEvent,
    LocalProgress,
    LocalReady,
    LocalResult,
    LocalShard,
    Progress,
    RankStat,
    RankSummary,
    ShardInfo,
    WorkerEvent,
)
from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.grants import LocalStorageRequest
from trainyard.protocol.restart import NEXT_ASSIGNMENT, LocalNextAssignment
from trainyard.protocol.uploads import LocalSlotRelease, LocalSlotRequest

log = structlog.get_logger(__name__)

_ROUTE = re.compile(
    rf"^{re.escape(LOCAL_API_PREFIX)}/attempts/(?P<attempt_id>[^/]+)/"
    r"(?P<kind>progress|result|ready|shards|events|storage|checkpoint-interval|upload-slot|upload-slot/release"
    r"|next-assignment)$"
)
_DIGITS = re.compile(r"[0-9]{1,20}")
MAX_BODY = 1024 * 1024
SHARD_WAIT_S = 30.0
BASE_URL = "http://trainyard-agent"
"""TRAINYARD_AGENT_URL: the connection goes to TRAINYARD_AGENT_SOCKET; this only names the host."""
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, NUL included

GrantForwarder = Callable[[str, LocalStorageRequest], tuple[HTTPStatus, dict[str, Any]]]
"""Asks the control plane for a worker's storage grants (the agent's): (status, JSON body)."""


@dataclass(frozen=True, kw_only=True)
class LocalApiLimits:
    max_body: int = MAX_BODY
    """Largest request body (Content-Length) accepted."""
    request_timeout_s: float = 10.0
    """The whole request (line, headers, body) must arrive within this; also the send timeout."""
    connections_per_attempt: int = 16
    """Connections of one attempt served at once, before those of its ranks (connections_per_rank)."""
    connections_per_rank: int = 2
    """More for each rank of the attempt's part (``open(ranks=...)``): every rank may hold two long
    waits at once (its upload-slot poll, up to upload_slot_poll_s, and a shard's ?wait=1), so a part
    of many ranks waiting together never starves its own progress reports."""
    connections_total: int = 128
    """Connections served at once in all, before the ranks' share (which adds to it too)."""

    def __post_init__(self) -> None:
        if self.max_body < 1 or self.request_timeout_s <= 0:
            raise ValueError("max_body and request_timeout_s must be > 0")
        if not 1 <= self.connections_per_attempt <= self.connections_total:
            raise ValueError("need 1 <= connections_per_attempt <= connections_total")
        if self.connections_per_rank < 0:
            raise ValueError("connections_per_rank must be >= 0")


@dataclass
class _Rank:
    """What one local rank last told (monotonic instants of this agent)."""

    step: int
    seen: float
    advanced: float
    step_time_s: float | None = None
    busy_s: float | None = None


@dataclass
class _AttemptReports:
    fencing_token: bytes
    progress: Progress | None = None
    result: dict[str, Any] | None = None
    result_rank: int | None = None
    ranks: dict[int, _Rank] = field(default_factory=dict)
    checkpoint_interval_steps: int | None = None
    ready: dict[int, float] = field(default_factory=dict)
    """Rank -> when it said its process group is initialised (this agent's monotonic clock)."""


def _token_bytes(token: str) -> bytes:
    # A JSON string may hold a lone surrogate: it must compare unequal, not raise.
    return token.encode("utf-8", "surrogatepass")


class LocalReports:
    """Thread-safe store of the latest progress and the result of each registered attempt."""

    def __init__(self, on_ready: Callable[[], None] | None = None) -> None:
        """``on_ready``: called (outside the lock) when a rank of a registered attempt says ready, and
        when the attempt's first step arrives: the report loop sends both at once rather than at its
        next pass (a recovery's rendezvous and restore phases end there)."""
        self._lock = threading.Lock()
        self._attempts: dict[str, _AttemptReports] = {}
        self._on_ready = on_ready

    def register(self, attempt_id: str, fencing_token: str) -> None:
        with self._lock:
            self._attempts.setdefault(attempt_id, _AttemptReports(_token_bytes(fencing_token)))

    def unregister(self, attempt_id: str) -> None:
        with self._lock:
            self._attempts.pop(attempt_id, None)

    def accepts(self, attempt_id: str, fencing_token: str) -> bool:
        """The attempt is registered here with this fencing token."""
        with self._lock:
            return self._get(attempt_id, fencing_token) is not None

    def _get(self, attempt_id: str, fencing_token: str) -> _AttemptReports | None:
        entry = self._attempts.get(attempt_id)
        if entry is None or not hmac.compare_digest(entry.fencing_token, _token_bytes(fencing_token)):
            return None
        return entry

    def add_progress(self, attempt_id: str, body: LocalProgress) -> bool:
        with self._lock:
            entry = self._get(attempt_id, body.fencing_token)
            if entry is None:
                return False
            self._rank_report(entry, body)
            if body.rank != 0 and body.loss is None and not body.metrics:
                return True  # another rank's step and timings only: its node's RankSummary
            # Ranks report in any order; the attempt's progress is the furthest step seen.
            first = entry.progress is None
            if entry.progress is None or body.step >= entry.progress.step:
                entry.progress = Progress(step=body.step, loss=body.loss, metrics=body.metrics,
                                          total_steps=body.total_steps, at=datetime.now(UTC))
        if first and self._on_ready is not None:
            self._on_ready()
        return True

    @staticmethod
    def _rank_report(entry: _AttemptReports, body: LocalProgress) -> None:
        t = time.monotonic()
        rank = entry.ranks.get(body.rank)
        if rank is None:
            if len(entry.ranks) >= MAX_NODE_RANKS:
                return
            entry.ranks[body.rank] = rank = _Rank(step=body.step, seen=t, advanced=t)
        rank.seen = t
        if body.step > rank.step:
            rank.step, rank.advanced = body.step, t
        rank.step_time_s = body.step_time_s if body.step_time_s is not None else rank.step_time_s
        rank.busy_s = body.busy_s if body.busy_s is not None else rank.busy_s

    def rank_summary(self, attempt_id: str) -> RankSummary | None:
        """This node's ranks of the attempt as they stand now; None before any reported."""
        t = time.monotonic()
        with self._lock:
            entry = self._attempts.get(attempt_id)
            if entry is None or not entry.ranks:
                return None
            return RankSummary(ranks=[
                RankStat(rank=r, step=s.step, step_time_s=s.step_time_s, busy_s=s.busy_s,
                         silent_s=round(t - s.seen, 3), stalled_s=round(t - s.advanced, 3))
                for r, s in sorted(entry.ranks.items())
            ])

    def set_ready(self, attempt_id: str, body: LocalReady) -> bool:
        with self._lock:
            entry = self._get(attempt_id, body.fencing_token)
            if entry is None:
                return False
            if len(entry.ready) < MAX_NODE_RANKS:
                entry.ready.setdefault(body.rank, time.monotonic())
        if self._on_ready is not None:
            self._on_ready()
        return True

    def stepped(self, attempt_id: str, ranks: int) -> bool:
        """Each of the part's ``ranks`` ranks has reported a step (it is past its start and restore)."""
        with self._lock:
            entry = self._attempts.get(attempt_id)
            return entry is not None and len(entry.ranks) >= ranks

    def initialized_at(self, attempt_id: str, ranks: int) -> float | None:
        """When the last of the part's ``ranks`` ranks said it is ready (monotonic); None before all did."""
        with self._lock:
            entry = self._attempts.get(attempt_id)
            if entry is None or ranks < 1 or len(entry.ready) < ranks:
                return None
            return max(entry.ready.values())

    def set_checkpoint_interval(self, attempt_id: str, steps: int | None) -> None:
        with self._lock:
            entry = self._attempts.get(attempt_id)
            if entry is not None and steps is not None:
                entry.checkpoint_interval_steps = steps

    def checkpoint_interval(self, attempt_id: str, fencing_token: str) -> tuple[bool, int | None]:
        """(whether the attempt is here with this token, the interval the control plane set)."""
        with self._lock:
            entry = self._get(attempt_id, fencing_token)
            return (False, None) if entry is None else (True, entry.checkpoint_interval_steps)

    def set_result(self, attempt_id: str, body: LocalResult) -> bool:
        with self._lock:
            entry = self._get(attempt_id, body.fencing_token)
            if entry is None:
                return False
            # Rank 0 speaks for the attempt; another rank's result only fills in until it does.
            if entry.result_rank != 0:
                entry.result, entry.result_rank = body.result, body.rank
            return True

    def snapshot(self, attempt_id: str) -> tuple[Progress | None, dict[str, Any] | None]:
        with self._lock:
            entry = self._attempts.get(attempt_id)
            return (None, None) if entry is None else (entry.progress, entry.result)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is not finite")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON can carry")


def parse_body(raw: bytes) -> Any:
    """JSON with finite numbers only (ValueError otherwise)."""
    return json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)


@dataclass
class _Context:
    """What a handler needs: the stores, and the one attempt its socket serves."""

    attempt_id: str
    reports: LocalReports
    outbox: Outbox
    shard_wait_s: float
    limits: LocalApiLimits
    grants: GrantForwarder | None = None
    slots: SlotRelay | None = None
    memory: MemoryTier | None = None
    attempt_memory: AttemptMemory | None = None
    handovers: Handovers | None = None


class _Handler(BaseHTTPRequestHandler):
    server: _Context  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.connection = self.request
        deadline = time.monotonic() + self.server.limits.request_timeout_s
        self.reader = DeadlineReader(self.connection, deadline)
        self.rfile = io.BufferedReader(self.reader)
        self.wfile = SocketWriter(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # requests are routine; errors are logged where they are answered

    def _send(self, status: HTTPStatus, payload: dict[str, Any], content_type: str) -> None:
        self.close_connection = True  # one request per connection: its deadline covers it all
        self.connection.settimeout(self.server.limits.request_timeout_s)
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _problem(self, status: HTTPStatus, detail: str, errors: Any = None, problem_type: str | None = None,
                 **extra: Any) -> None:
        payload: dict[str, Any] = {"type": problem_type or "about:blank", "title": status.phrase,
                                   "status": int(status)}
        payload["detail"] = detail
        if errors is not None:
            payload["errors"] = errors
        payload.update({k: v for k, v in extra.items() if v is not None})
        self._send(status, payload, "application/problem+json")

    def _memory(self) -> bool:
        """Serve a request of the in-memory checkpoint tier (memtier/local.py); False: not one."""
        match = MEMORY_ROUTE.match(self.path.partition("?")[0])
        if match is None:
            return False
        serve_memory(self, match)
        return True

    def do_PUT(self) -> None:  # noqa: N802 - stdlib naming
        if not self._memory():
            self._problem(HTTPStatus.NOT_FOUND, f"no route {self.path[:200]}")

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self._memory():
            return
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, {"ok": True}, "application/json")
        else:
            self._problem(HTTPStatus.NOT_FOUND, f"no route {self.path[:200]}")

    def _body(self) -> bytes | None:
        """The request body, or None when it was refused (the answer is sent)."""
        limit = self.server.limits.max_body
        if self.headers.get("Transfer-Encoding"):
            self._problem(HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length, not chunked")
            return None
        text = self.headers.get("Content-Length")
        if text is None:
            self._problem(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
            return None
        if not _DIGITS.fullmatch(text.strip()):  # no sign, no exponent: -1 and "1e3" are not lengths
            self._problem(HTTPStatus.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a byte count")
            return None
        length = int(text)
        if length > limit:
            self._problem(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {limit} bytes")
            return None
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise TimeoutError("the body ended early")
        return raw

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        path, _, query = self.path.partition("?")
        match = _ROUTE.match(path)
        raw = self._body()
        if raw is None:
            return
        if match is None:
            self._problem(HTTPStatus.NOT_FOUND, f"no route {path[:200]}")
            return
        attempt_id, kind = unquote(match["attempt_id"]), match["kind"]
        if attempt_id != self.server.attempt_id:
            self._problem(HTTPStatus.FORBIDDEN, "this socket serves its own attempt only")
            return
        try:
            payload = parse_body(raw)
        except (ValueError, RecursionError) as exc:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, f"invalid JSON body: {str(exc)[:200]}")
            return
        try:
            if kind.startswith("upload-slot"):
                self._upload_slot(attempt_id, kind, payload)
                return
            if kind in ("shards", "events"):
                self._queue(attempt_id, kind, payload, wait=_truthy(parse_qs(query).get("wait", [""])[-1]))
                return
            if kind == "storage":
                self._storage(attempt_id, LocalStorageRequest.model_validate(payload))
                return
            if kind == NEXT_ASSIGNMENT:
                self._next_assignment(attempt_id, LocalNextAssignment.model_validate(payload))
                return
            reports = self.server.reports
            if kind == "checkpoint-interval":
                body = LocalCheckpointInterval.model_validate(payload)
                accepted, steps = reports.checkpoint_interval(attempt_id, body.fencing_token)
                if accepted:
                    self._send(HTTPStatus.OK, {"interval_steps": steps}, "application/json")
                    return
            elif kind == "progress":
                accepted = reports.add_progress(attempt_id, LocalProgress.model_validate(payload))
            elif kind == "ready":
                accepted = reports.set_ready(attempt_id, LocalReady.model_validate(payload))
            else:
                accepted = reports.set_result(attempt_id, LocalResult.model_validate(payload))
        except ValidationError as exc:
            errors = json.loads(exc.json(include_url=False, include_input=False))
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, "invalid body", errors)
            return
        if not accepted:
            self._fenced_off(attempt_id, kind)
            return
        self._send(HTTPStatus.OK, {"accepted": True}, "application/json")

    def _fenced_off(self, attempt_id: str, kind: str) -> None:
        log.info("local_report_rejected", attempt_id=attempt_id, kind=kind)
        self._problem(HTTPStatus.CONFLICT, f"attempt {attempt_id} is not running here or is fenced off")

    def _upload_slot(self, attempt_id: str, kind: str, payload: Any) -> None:
        """Relay a slot request or release (raises ValidationError for a bad body)."""
        body = (LocalSlotRelease if kind.endswith("/release") else LocalSlotRequest).model_validate(payload)
        if not self.server.reports.accepts(attempt_id, body.fencing_token):
            self._fenced_off(attempt_id, kind)
            return
        slots = self.server.slots
        if slots is None:
            self._problem(HTTPStatus.NOT_FOUND, "this agent relays no upload slots")
            return
        if isinstance(body, LocalSlotRelease):
            status, payload = slots.release(attempt_id, body)
        else:
            status, payload = slots.ask(attempt_id, body)
        if status == HTTPStatus.OK:
            self._send(status, payload, "application/json")
            return
        retry = payload.get("retry_after_s")
        self._problem(status, str(payload.get("detail", "")), upstream_status=payload.get("upstream_status"),
                      retry_after_s=retry)

    def _next_assignment(self, attempt_id: str, body: LocalNextAssignment) -> None:
        """A worker of a restartable part asks for its part of the next attempt (node_agent/local/handover.py):
        404 when this part is not restartable here, 409 for another token."""
        handovers = self.server.handovers
        if handovers is None:
            self._problem(HTTPStatus.NOT_FOUND, "this agent hands no attempt over")
            return
        try:
            answer = handovers.answer(attempt_id, body.fencing_token, body.rank, body.wait_s)
        except ValueError as exc:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc))
            return
        if answer is None:
            self._fenced_off(attempt_id, NEXT_ASSIGNMENT)
            return
        self._send(HTTPStatus.OK, answer.model_dump(mode="json"), "application/json")

    def _storage(self, attempt_id: str, body: LocalStorageRequest) -> None:
        if not self.server.reports.accepts(attempt_id, body.fencing_token):
            self._fenced_off(attempt_id, "storage")
            return
        forward = self.server.grants
        if forward is None:
            self._problem(HTTPStatus.SERVICE_UNAVAILABLE, "this agent does not forward storage requests")
            return
        status, payload = forward(attempt_id, body)
        if status == HTTPStatus.OK:
            self._send(status, payload, "application/json")
        else:
            self._problem(status, str(payload.get("detail", "")), problem_type=payload.get("type"))

    def _queue(self, attempt_id: str, kind: str, payload: Any, *, wait: bool) -> None:
        """Queue a shard or an event for the relay; raises ValidationError for a bad body."""
        item: ShardInfo | WorkerEvent
        if kind == "shards":
            shard = LocalShard.model_validate(payload)
            token, item = shard.fencing_token, ShardInfo.model_validate(shard.model_dump(exclude={"fencing_token"}))
        else:
            event = LocalEvent.model_validate(payload)
            token = event.fencing_token
            # Stamped now when the worker did not: it may reach the control plane much later.
            item = WorkerEvent.model_validate(event.model_dump(exclude={"fencing_token"}))
            item.at = item.at or datetime.now(UTC)
            wait = False  # only shards have an acknowledgement worth waiting for
        if not self.server.reports.accepts(attempt_id, token):
            self._fenced_off(attempt_id, kind)
            return
        waiter = self.server.outbox.put(attempt_id, "shard" if kind == "shards" else "event", item, wait=wait)
        if waiter is None:
            self._send(HTTPStatus.ACCEPTED, {"accepted": True, "queued": True}, "application/json")
            return
        if not waiter.wait(self.server.shard_wait_s):
            wait_s = self.server.shard_wait_s
            detail = f"the control plane did not acknowledge the shard within {wait_s:g}s; it stays queued"
            self._problem(HTTPStatus.GATEWAY_TIMEOUT, detail)
        elif waiter.status == HTTPStatus.OK:
            self._send(HTTPStatus.OK, waiter.payload, "application/json")
        else:
            detail = str(waiter.payload.get("detail", ""))
            self._problem(waiter.status, detail, upstream_status=waiter.payload.get("upstream_status"))


def _truthy(value: str) -> bool:
    return value.lower() in ("1", "true", "yes")


class _Listener:
    """One attempt's socket and its accept thread."""

    def __init__(self, api: LocalApi, attempt_id: str, path: Path, sock: socket.socket, extra: int,
                 memory: AttemptMemory | None = None) -> None:
        self.api = api
        self.path = path
        self.sock = sock
        self.extra = extra
        """Connections this attempt's ranks add to its cap and to the API's."""
        self.active = Gate(api.limits.connections_per_attempt + extra)
        self.serving = 0
        """Connections being served now (for diagnostics and tests)."""
        self._count = threading.Lock()
        self.context = _Context(attempt_id, api.reports, api.outbox, api.shard_wait_s, api.limits, api.grants,
                                api.slots, api.memory, memory, api.handovers)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept_loop, name=f"local-api-{attempt_id[:12]}", daemon=True)

    def _accept_loop(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            if not self.active.acquire():
                refuse(conn)
            elif not self.api.active.acquire():
                self.active.release()
                refuse(conn)
            else:
                with self._count:
                    self.serving += 1
                threading.Thread(target=self._serve, args=(conn,), name="local-api-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            _Handler(conn, ("local", 0), self.context)  # type: ignore[arg-type]
        except Exception as exc:  # a broken connection must never take the accept loop down
            log.info("local_api_connection_failed", attempt_id=self.context.attempt_id, error=str(exc)[:200])
        finally:
            with contextlib.suppress(OSError):
                conn.close()
            with self._count:
                self.serving -= 1
            self.api.active.release()
            self.active.release()

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept at once
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class LocalApi:
    """Unix sockets, one per attempt part (`open` / `close`); `stop` closes them all (idempotent)."""

    def __init__(
        self,
        reports: LocalReports | None = None,
        outbox: Outbox | None = None,
        *,
        shard_wait_s: float = SHARD_WAIT_S,
        limits: LocalApiLimits | None = None,
        grants: GrantForwarder | None = None,
        slots: SlotRelay | None = None,
        memory: MemoryTier | None = None,
        handovers: Handovers | None = None,
    ) -> None:
        self.reports = reports or LocalReports()
        self.memory = memory
        self.handovers = handovers
        self.outbox = outbox or Outbox()
        self.shard_wait_s = shard_wait_s
        self.grants = grants
        self.slots = slots
        self.limits = limits or LocalApiLimits()
        self.active = Gate(self.limits.connections_total)
        self._lock = threading.Lock()
        self._listeners: dict[str, _Listener] = {}
        self._stopped = False

    def open(self, attempt_id: str, path: Path, *, uid: int | None = None, gid: int | None = None,
             ranks: int = 0, memory: AttemptMemory | None = None) -> None:
        """Serve ``attempt_id`` on a socket at ``path`` that only ``uid`` (and the agent) may
        connect to; a socket a previous agent left there is replaced. Idempotent per attempt.
        ``ranks``: the part's ranks on this node; each adds connections_per_rank to the caps.
        ``memory``: the part's in-memory checkpoint tier (its job and peer), None: off for it."""
        extra = self.limits.connections_per_rank * max(0, ranks)
        with self._lock:
            if self._stopped or attempt_id in self._listeners:
                return
            if len(os.fsencode(path)) > MAX_SOCKET_PATH:
                raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter --run-dir")
            # Bound under a random name, made private, then renamed: no moment where another user
            # could connect to it.
            tmp = path.with_name(f".{secrets.token_hex(8)}.tmp")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.bind(str(tmp))
                os.chmod(tmp, 0o600)
                if uid is not None and gid is not None:
                    os.lchown(tmp, uid, gid)
                os.replace(tmp, path)
                sock.listen(max(64, self.limits.connections_per_attempt + extra))
                sock.settimeout(0.5)
            except BaseException:
                sock.close()
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            listener = _Listener(self, attempt_id, path, sock, extra, memory)
            self._listeners[attempt_id] = listener
            self.active.resize(extra)
        listener.thread.start()

    def close(self, attempt_id: str) -> None:
        with self._lock:
            listener = self._listeners.pop(attempt_id, None)
            if listener is not None:
                self.active.resize(-listener.extra)
        if listener is not None:
            listener.close()

    def serving(self, attempt_id: str) -> int:
        """Connections of the attempt being served now."""
        with self._lock:
            listener = self._listeners.get(attempt_id)
        return 0 if listener is None else listener.serving

    def socket_of(self, attempt_id: str) -> Path | None:
        with self._lock:
            listener = self._listeners.get(attempt_id)
            return None if listener is None else listener.path

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            listener.close()
        for listener in listeners:
            listener.thread.join(timeout=2)
