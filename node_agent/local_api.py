"""The agent's HTTP API for its own workers: progress, results, checkpoint shards and events,
fenced by the attempt's token.

    POST /v1/local/attempts/{attempt_id}/progress   LocalProgress -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/result     LocalResult   -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/events     LocalEvent    -> 202 {"accepted": true, "queued": true}
    POST /v1/local/attempts/{attempt_id}/shards     LocalShard    -> 202 {"accepted": true, "queued": true}
    POST /v1/local/attempts/{attempt_id}/shards?wait=1            -> 200 ShardAck of the control plane
    POST /v1/local/attempts/{attempt_id}/upload-slot          LocalSlotRequest -> 200 SlotAnswer
    POST /v1/local/attempts/{attempt_id}/upload-slot/release  LocalSlotRelease -> 200 SlotReleased
    POST /v1/local/attempts/{attempt_id}/storage          LocalStorageRequest -> 200 StorageGrants of the control plane

An attempt unknown to the agent (never launched here, stale, or finished) or a wrong fencing
token gets 409 problem+json: a worker of a superseded attempt learns it is fenced off. The agent
forwards progress and result in the attempt's next status report; shards and events are queued
for the relay (relay.py) and answered at once. With ?wait=1 a shard is answered once the control
plane acknowledged the batch holding it (so the worker learns from `committed_steps` whether its
step is committed): 409 if the control plane says the attempt is stale, 422 if it refused the
shard, 504 if no answer came within `shard_wait_s` (the shard stays queued), 503 if it was dropped.
Upload-slot requests are relayed to the control plane as they come (upload_slots.py); an agent
built without a relay answers them 404 (the worker then uploads without a slot).
A storage request (presigned URLs for checkpoint objects, trainyard/protocol/grants.py) is
forwarded to the control plane at once and answered with its answer: the grants, or its refusal
(403, 404, 409, 422); 503 when it cannot be reached.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote

import structlog
from pydantic import ValidationError

from node_agent.relay import Outbox
from node_agent.upload_slots import SlotRelay
from trainyard.protocol.agent import (
    LocalEvent,
    LocalProgress,
    LocalResult,
    LocalShard,
    Progress,
    ShardInfo,
    WorkerEvent,
)
from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.grants import LocalStorageRequest
from trainyard.protocol.uploads import LocalSlotRelease, LocalSlotRequest

log = structlog.get_logger(__name__)

_ROUTE = re.compile(
    rf"^{re.escape(LOCAL_API_PREFIX)}/attempts/(?P<attempt_id>[^/]+)/(?P<kind>progress|result|shards|events|storage|upload-slot|upload-slot/release)$"
)
MAX_BODY = 1024 * 1024
SHARD_WAIT_S = 30.0

GrantForwarder = Callable[[str, LocalStorageRequest], tuple[HTTPStatus, dict[str, Any]]]
"""Asks the control plane for a worker's storage grants (the agent's): (status, JSON body)."""


@dataclass
class _AttemptReports:
    fencing_token: str
    progress: Progress | None = None
    result: dict[str, Any] | None = None
    result_rank: int | None = None


class LocalReports:
    """Thread-safe store of the latest progress and the result of each registered attempt."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._attempts: dict[str, _AttemptReports] = {}

    def register(self, attempt_id: str, fencing_token: str) -> None:
        with self._lock:
            self._attempts.setdefault(attempt_id, _AttemptReports(fencing_token))

    def unregister(self, attempt_id: str) -> None:
        with self._lock:
            self._attempts.pop(attempt_id, None)

    def accepts(self, attempt_id: str, fencing_token: str) -> bool:
        """The attempt is registered here with this fencing token."""
        with self._lock:
            return self._get(attempt_id, fencing_token) is not None

    def _get(self, attempt_id: str, fencing_token: str) -> _AttemptReports | None:
        entry = self._attempts.get(attempt_id)
        return entry if entry is not None and entry.fencing_token == fencing_token else None

    def add_progress(self, attempt_id: str, body: LocalProgress) -> bool:
        with self._lock:
            entry = self._get(attempt_id, body.fencing_token)
            if entry is None:
                return False
            # Ranks report in any order; the attempt's progress is the furthest step seen.
            if entry.progress is None or body.step >= entry.progress.step:
                entry.progress = Progress(step=body.step, loss=body.loss, metrics=body.metrics, at=datetime.now(UTC))
            return True

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


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # requests are routine; errors are logged where they are answered

    def _send(self, status: HTTPStatus, payload: dict[str, Any], content_type: str) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
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

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, {"ok": True}, "application/json")
        else:
            self._problem(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        path, _, query = self.path.partition("?")
        match = _ROUTE.match(path)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY:
            self.close_connection = True
            self._problem(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {MAX_BODY} bytes")
            return
        raw = self.rfile.read(length)
        if match is None:
            self._problem(HTTPStatus.NOT_FOUND, f"no route {self.path}")
            return
        attempt_id, kind = unquote(match["attempt_id"]), match["kind"]
        try:
            if kind.startswith("upload-slot"):
                self._upload_slot(attempt_id, kind, raw)
                return
            if kind in ("shards", "events"):
                self._queue(attempt_id, kind, raw, wait=_truthy(parse_qs(query).get("wait", [""])[-1]))
                return
            if kind == "storage":
                self._storage(attempt_id, LocalStorageRequest.model_validate_json(raw))
                return
            if kind == "progress":
                accepted = self.server.reports.add_progress(attempt_id, LocalProgress.model_validate_json(raw))
            else:
                accepted = self.server.reports.set_result(attempt_id, LocalResult.model_validate_json(raw))
        except ValidationError as exc:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, "invalid body", json.loads(exc.json()))
            return
        if not accepted:
            self._fenced_off(attempt_id, kind)
            return
        self._send(HTTPStatus.OK, {"accepted": True}, "application/json")

    def _fenced_off(self, attempt_id: str, kind: str) -> None:
        log.info("local_report_rejected", attempt_id=attempt_id, kind=kind)
        self._problem(HTTPStatus.CONFLICT, f"attempt {attempt_id} is not running here or is fenced off")

    def _upload_slot(self, attempt_id: str, kind: str, raw: bytes) -> None:
        """Relay a slot request or release (raises ValidationError for a bad body)."""
        body = (LocalSlotRelease if kind.endswith("/release") else LocalSlotRequest).model_validate_json(raw)
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

    def _queue(self, attempt_id: str, kind: str, raw: bytes, *, wait: bool) -> None:
        """Queue a shard or an event for the relay; raises ValidationError for a bad body."""
        item: ShardInfo | WorkerEvent
        if kind == "shards":
            shard = LocalShard.model_validate_json(raw)
            token, item = shard.fencing_token, ShardInfo.model_validate(shard.model_dump(exclude={"fencing_token"}))
        else:
            event = LocalEvent.model_validate_json(raw)
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], reports: LocalReports, outbox: Outbox, shard_wait_s: float,
                 grants: GrantForwarder | None, slots: SlotRelay | None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.reports = reports
        self.outbox = outbox
        self.shard_wait_s = shard_wait_s
        self.slots = slots
        self.grants = grants


class LocalApi:
    """The server, on its own thread. `start` binds (port 0: any free port); `stop` is idempotent."""

    def __init__(
        self,
        host: str,
        port: int,
        reports: LocalReports | None = None,
        outbox: Outbox | None = None,
        *,
        shard_wait_s: float = SHARD_WAIT_S,
        grants: GrantForwarder | None = None,
        slots: SlotRelay | None = None,
    ) -> None:
        self.reports = reports or LocalReports()
        self.outbox = outbox or Outbox()
        self._server = _Server((host, port), self.reports, self.outbox, shard_wait_s, grants, slots)
        self._thread: threading.Thread | None = None
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = str(host)
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="local-api",
                daemon=True,
            )
            self._thread.start()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()
