"""The agent's HTTP API for its own workers: progress and results, fenced by the attempt's token.

    POST /v1/local/attempts/{attempt_id}/progress   LocalProgress -> 200 {"accepted": true}
    POST /v1/local/attempts/{attempt_id}/result     LocalResult   -> 200 {"accepted": true}

An attempt unknown to the agent (never launched here, stale, or finished) or a wrong fencing
token gets 409 problem+json: a worker of a superseded attempt learns it is fenced off. The agent
forwards what it keeps here in the attempt's next status report.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote

import structlog
from pydantic import ValidationError

from control_plane.schemas.agent import LocalProgress, LocalResult, Progress

log = structlog.get_logger(__name__)

_ROUTE = re.compile(r"^/v1/local/attempts/(?P<attempt_id>[^/]+)/(?P<kind>progress|result)$")
MAX_BODY = 1024 * 1024


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

    def _problem(self, status: HTTPStatus, detail: str, errors: Any = None) -> None:
        payload: dict[str, Any] = {"type": "about:blank", "title": status.phrase, "status": int(status)}
        payload["detail"] = detail
        if errors is not None:
            payload["errors"] = errors
        self._send(status, payload, "application/problem+json")

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, {"ok": True}, "application/json")
        else:
            self._problem(HTTPStatus.NOT_FOUND, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - stdlib naming
        match = _ROUTE.match(self.path.split("?", 1)[0])
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
        reports = self.server.reports
        try:
            if kind == "progress":
                accepted = reports.add_progress(attempt_id, LocalProgress.model_validate_json(raw))
            else:
                accepted = reports.set_result(attempt_id, LocalResult.model_validate_json(raw))
        except ValidationError as exc:
            self._problem(HTTPStatus.UNPROCESSABLE_ENTITY, "invalid body", json.loads(exc.json()))
            return
        if not accepted:
            log.info("local_report_rejected", attempt_id=attempt_id, kind=kind)
            self._problem(HTTPStatus.CONFLICT, f"attempt {attempt_id} is not running here or is fenced off")
            return
        self._send(HTTPStatus.OK, {"accepted": True}, "application/json")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], reports: LocalReports) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.reports = reports


class LocalApi:
    """The server, on its own thread. `start` binds (port 0: any free port); `stop` is idempotent."""

    def __init__(self, host: str, port: int, reports: LocalReports | None = None) -> None:
        self.reports = reports or LocalReports()
        self._server = _Server((host, port), self.reports)
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
