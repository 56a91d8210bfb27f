"""A fake node agent: the local API on a real socket, recording what workers send."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    path: str
    body: dict[str, Any]


@dataclass
class FakeAgent:
    """Records every POST; answers with the next status queued for its kind, else 200.

    ``gate`` (set by default) lets a test hold answers back to play a hung agent.
    """

    url: str = ""
    requests: list[Request] = field(default_factory=list)
    statuses: dict[str, list[int]] = field(default_factory=dict)
    always: dict[str, int] = field(default_factory=dict)
    gate: threading.Event = field(default_factory=threading.Event)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def answer(self, kind: str) -> int:
        with self._cond:
            queued = self.statuses.get(kind)
            if queued:
                return queued.pop(0)
            return self.always.get(kind, 200)

    def record(self, request: Request) -> None:
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()

    def of(self, kind: str) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if r.path.endswith("/" + kind)]

    def wait_for(self, kind: str, count: int, timeout: float = 10.0) -> list[Request]:
        with self._cond:
            ok = self._cond.wait_for(lambda: len(self.of(kind)) >= count, timeout)
        assert ok, f"agent got {len(self.of(kind))} {kind} reports, expected {count}"
        return self.of(kind)


def _handler(agent: FakeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass

        def do_POST(self) -> None:  # noqa: N802 - stdlib naming
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            agent.gate.wait(30)
            agent.record(Request(self.path, json.loads(raw)))
            status = agent.answer(self.path.rsplit("/", 1)[-1])
            body = json.dumps({"accepted": status == 200, "status": status}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@contextmanager
def serve_fake_agent() -> Iterator[FakeAgent]:
    """Run a FakeAgent on 127.0.0.1 (any free port) until the block ends."""
    agent = FakeAgent()
    agent.gate.set()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(agent))
    server.daemon_threads = True
    agent.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="fake-agent", daemon=True)
    thread.start()
    try:
        yield agent
    finally:
        agent.gate.set()
        server.shutdown()
        server.server_close()
        thread.join(5)
