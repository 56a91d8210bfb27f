"""A fake node agent: the local API on a real socket, recording what workers send.

Like the real one (node_agent/local/api.py) it answers progress and result with 200, shards and
events with 202 (queued), ``shards?wait=1`` with the control plane's ShardAck, ``upload-slot``
with ``slot_answer`` (by default a slot granted at once, unpaced, as with no limit configured) and
its ``release`` with ``{"released": true}``. A status queued in ``statuses`` or set in ``always``
replaces the answer (an error body then).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

GRANTED: dict[str, Any] = {"slot_id": "slot-1", "state": "granted", "position": 0, "retry_after_s": 0.0,
                           "rate_bytes_per_s": None, "ttl_s": 30.0, "max_wait_s": None}


@dataclass
class Request:
    path: str
    body: dict[str, Any]
    query: str = ""


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
    committed_steps: list[int] = field(default_factory=list)
    """What a ``shards?wait=1`` answer says is committed."""
    slot_answer: dict[str, Any] = field(default_factory=lambda: dict(GRANTED))
    """What an ``upload-slot`` request is answered."""
    handover: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What a ``next-assignment`` request with a given fencing token is answered (its agent's
    handover of that attempt part); a token not listed is told to wait."""
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def answer(self, kind: str) -> int | None:
        """The status queued or set for ``kind``; None for the normal answer."""
        with self._cond:
            queued = self.statuses.get(kind)
            if queued:
                return queued.pop(0)
            return self.always.get(kind)

    def record(self, request: Request) -> None:
        with self._cond:
            self.requests.append(request)
            self._cond.notify_all()

    def of(self, kind: str) -> list[Request]:
        with self._cond:
            return [r for r in self.requests if r.path.endswith("/" + kind)]

    def shards(self, step: int | None = None) -> list[dict[str, Any]]:
        """Bodies of the shard reports (of ``step``), in arrival order."""
        return [r.body for r in self.of("shards") if step is None or r.body["step"] == step]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Bodies of the event reports (of ``kind``), in arrival order."""
        return [r.body for r in self.of("events") if kind is None or r.body["kind"] == kind]

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
            path, _, query = self.path.partition("?")
            agent.record(Request(path, json.loads(raw), query))
            kind = path.rsplit("/", 1)[-1]
            status = agent.answer(kind)
            if status is not None:
                payload: dict[str, Any] = {"accepted": status < 300, "status": status}
            elif kind == "shards" and "wait=1" in query:
                status, payload = 200, {"accepted": 1, "committed_steps": list(agent.committed_steps)}
            elif kind in ("shards", "events"):
                status, payload = 202, {"accepted": True, "queued": True}
            elif kind == "upload-slot":
                status, payload = 200, dict(agent.slot_answer)
            elif kind == "release":
                status, payload = 200, {"released": True}
            elif kind == "next-assignment":
                with agent._cond:
                    answer = agent.handover.get(json.loads(raw).get("fencing_token", ""))
                if answer is None:
                    time.sleep(0.1)  # a long poll that found nothing yet
                status, payload = 200, answer or {"state": "waiting"}
            else:
                status, payload = 200, {"accepted": True, "status": 200}
            body = json.dumps(payload).encode()
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


def manifest_from_shards(
    shards: list[dict[str, Any]],
    *,
    job_id: str,
    attempt_id: str,
    attempt_number: int,
    step: int,
    world_size: int,
    num_nodes: int = 1,
) -> dict[str, Any]:
    """The manifest the control plane would commit from these shard reports (``_manifest`` in
    control_plane/services/checkpoints/checkpoints.py), checking what ``record_shards`` checks."""
    from control_plane.services.checkpoints.checkpoints import checkpoint_prefix

    prefix = checkpoint_prefix(job_id, step, attempt_number)
    mine = {s["rank"]: s for s in shards if s["step"] == step}
    assert sorted(mine) == list(range(world_size)), f"step {step} has shards of ranks {sorted(mine)}"
    for s in mine.values():
        assert s["world_size"] == world_size and s["key"].startswith(prefix + "/"), s
    return {
        "format": "trainyard.checkpoint/1",
        "job_id": job_id,
        "checkpoint_id": f"ckpt-{step}",
        "step": step,
        "attempt_id": attempt_id,
        "attempt_number": attempt_number,
        "world_size": world_size,
        "layout": {"num_nodes": num_nodes, "gpus_per_node": world_size // num_nodes},
        "manifest_key": prefix + "/manifest.json",
        "shards": [{"rank": r, "key": mine[r]["key"], "size_bytes": mine[r]["size_bytes"],
                    "sha256": mine[r]["sha256"]} for r in sorted(mine)],
    }
