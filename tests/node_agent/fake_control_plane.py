"""A small in-process control plane that speaks the agent contract over real HTTP.

Just enough to drive an agent's loops: it registers nodes, answers heartbeats with the
assignments a test sets, records status reports, log chunks, checkpoint shards and worker events
(and the order they arrived in), and can be told to forget its nodes (401), to fence attempts off
(409, on everything or on shards and events only), to refuse a shard as conflicting (a typed 409
that is no fencing), to ask for a stop, or to be down (503).
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from trainyard.protocol.agent import (
    AttemptStatusAck,
    AttemptStatusReport,
    HeartbeatRequest,
    HeartbeatResponse,
    LaunchSpec,
    LogAck,
    LogBatch,
    RegisterRequest,
    RegisterResponse,
    ShardAck,
    ShardInfo,
    ShardReport,
    WorkerEvent,
    WorkerEventAck,
    WorkerEventBatch,
)

_ATTEMPT = re.compile(r"^/v1/agent/attempts/([^/]+)/(status|logs|shards|events)$")
CONFLICT_TYPE = "https://trainyard.dev/problems/conflict"


class FakeControlPlane:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, heartbeat_interval_s: float = 0.2) -> None:
        self.join_token = "join-secret"
        self.heartbeat_interval_s = heartbeat_interval_s
        self.lock = threading.Lock()
        self.node_ids: dict[str, str] = {}
        self.tokens: dict[str, str] = {}  # node token -> node name
        self.registered_with: list[str] = []  # "join" or "credential", per registration
        self.registrations: list[RegisterRequest] = []
        self.assignments: dict[str, list[LaunchSpec]] = defaultdict(list)
        self.heartbeats: list[tuple[str, HeartbeatRequest]] = []
        self.heartbeat_times: list[float] = []
        """When each heartbeat arrived (time.monotonic())."""
        self.code: dict[str, bytes] = {}
        """Per attempt, the code archive GET /v1/agent/attempts/{id}/code serves."""
        self.code_trickle_s = 0.0
        """How long serving an archive takes (sent in 16 pieces): a slow network."""
        self.statuses: dict[str, list[AttemptStatusReport]] = defaultdict(list)
        self.logs: dict[tuple[str, int, int, str], dict[int, str]] = defaultdict(dict)
        self.shards: dict[str, list[ShardInfo]] = defaultdict(list)
        self.events: dict[str, list[WorkerEvent]] = defaultdict(list)
        self.arrivals: dict[str, list[str]] = defaultdict(list)
        """Per attempt, in arrival order: 'shard:<step>:<rank>', 'event:<kind>', 'status:<state>'."""
        self.shard_batches: dict[str, list[int]] = defaultdict(list)
        """Sizes of the shard batches received."""
        self.senders: dict[str, set[tuple[str, int]]] = defaultdict(set)
        """(fencing token, node rank) of the shard and event batches received."""
        self.stale: set[str] = set()
        self.superseded: set[str] = set()
        """Attempts the control plane replaced: everything gets a fencing 409 but their logs, which
        are accepted under the attempt's own token (control_plane/services/logs.py), as for real."""
        self.stale_shards: set[str] = set()
        self.refused_stale: dict[str, int] = defaultdict(int)
        """Attempts whose shards and events get a fencing 409 (status reports are still accepted)."""
        self.conflicting_keys: set[str] = set()
        """Shard keys refused with a 409 of type 'conflict' (not stale)."""
        self.stop_requested: set[str] = set()
        self.refuse_status: set[str] = set()
        """Attempts whose status reports get a 503 (heartbeats still answered)."""
        self.reject_status: set[str] = set()
        self.rejected: dict[str, int] = defaultdict(int)  # status reports answered 422, per attempt
        """Attempts whose status reports get a 422 (an answer: resending will not help)."""
        self.busy_reports: dict[str, int] = {}
        """Attempts whose shards and events get a 503 with this Retry-After (a busy bookkeeping gate)."""
        self.busy_answered = 0
        self.down = False
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeControlPlane:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1})
        self._thread.daemon = True
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    # --- test-side views ---

    def assign(self, node: str, *specs: LaunchSpec) -> None:
        with self.lock:
            self.assignments[node] = list(specs)

    def forget_nodes(self) -> None:
        """As after a database reset: every node token is unknown now."""
        with self.lock:
            self.tokens.clear()

    def last_status(self, attempt_id: str) -> AttemptStatusReport | None:
        with self.lock:
            reports = self.statuses.get(attempt_id)
            return reports[-1] if reports else None

    def status_count(self, attempt_id: str) -> int:
        with self.lock:
            return len(self.statuses.get(attempt_id, []))

    def arrived(self, attempt_id: str) -> list[str]:
        with self.lock:
            return list(self.arrivals.get(attempt_id, []))

    def last_heartbeat(self, node: str) -> HeartbeatRequest | None:
        with self.lock:
            for name, hb in reversed(self.heartbeats):
                if name == node:
                    return hb
        return None

    def heartbeat_attempts(self, node: str) -> set[str] | None:
        hb = self.last_heartbeat(node)
        return None if hb is None else {a.attempt_id for a in hb.attempts if a.processes_alive}

    def log_text(self, attempt_id: str, node_rank: int, rank: int, stream: str) -> str:
        with self.lock:
            chunks = dict(self.logs.get((attempt_id, node_rank, rank, stream), {}))
        text, expected = "", 0
        for offset in sorted(chunks):
            assert offset == expected, f"gap in the log at {expected} (next chunk at {offset})"
            text += chunks[offset]
            expected = offset + len(chunks[offset].encode())
        return text

    # --- HTTP ---

    def _handle(self, path: str, token: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if self.down:
            return 503, {"title": "Service Unavailable", "status": 503}
        with self.lock:
            if path == "/v1/agent/register":
                req = RegisterRequest.model_validate_json(body)
                # The join token, or the node's own credential (as the real control plane).
                if token != self.join_token and self.tokens.get(token) != req.name:
                    return 401, {"title": "Unauthorized", "status": 401}
                self.registered_with.append("join" if token == self.join_token else "credential")
                self.registrations.append(req)
                node_id = self.node_ids.setdefault(req.name, f"node-{uuid.uuid4().hex[:8]}")
                node_token = f"tok-{uuid.uuid4().hex}"
                self.tokens[node_token] = req.name
                resp = RegisterResponse(
                    node_id=node_id,
                    node_token=node_token,
                    heartbeat_interval_s=self.heartbeat_interval_s,
                    node_lost_timeout_s=10.0,
                )
                return 200, resp.model_dump(mode="json")
            node = self.tokens.get(token)
            if node is None:
                return 401, {"title": "Unauthorized", "status": 401, "detail": "unknown node"}
            if path == "/v1/agent/heartbeat":
                hb = HeartbeatRequest.model_validate_json(body)
                self.heartbeats.append((node, hb))
                self.heartbeat_times.append(time.monotonic())
                hb_resp = HeartbeatResponse(
                    node_id=self.node_ids[node],
                    node_state="ready",
                    assignments=list(self.assignments[node]),
                    heartbeat_interval_s=self.heartbeat_interval_s,
                )
                return 200, hb_resp.model_dump(mode="json")
            match = _ATTEMPT.match(path)
            if match is None:
                return 404, {"title": "Not Found", "status": 404}
            attempt_id, kind = match.groups()
            if attempt_id in self.stale or (attempt_id in self.superseded and kind != "logs"):
                return 409, {"title": "Conflict", "status": 409, "detail": "stale attempt"}
            if kind in ("shards", "events"):
                return self._checkpoint_report(attempt_id, kind, body)
            if kind == "status" and attempt_id in self.refuse_status:
                return 503, {"title": "Service Unavailable", "status": 503}
            if kind == "status" and attempt_id in self.reject_status:
                self.rejected[attempt_id] += 1
                return 422, {"title": "Unprocessable Entity", "status": 422}
            if kind == "status":
                report = AttemptStatusReport.model_validate_json(body)
                self.statuses[attempt_id].append(report)
                self.arrivals[attempt_id].append(f"status:{report.state}")
                ack = AttemptStatusAck(attempt_state="running", stop=attempt_id in self.stop_requested)
                return 200, ack.model_dump(mode="json")
            batch = LogBatch.model_validate_json(body)
            for chunk in batch.chunks:
                self.logs[(attempt_id, batch.node_rank, chunk.rank, chunk.stream)][chunk.offset] = chunk.data
            return 200, LogAck(accepted=len(batch.chunks)).model_dump(mode="json")

    def _checkpoint_report(self, attempt_id: str, kind: str, body: bytes) -> tuple[int, dict[str, Any]]:
        if attempt_id in self.busy_reports:
            self.busy_answered += 1
            return 503, {"title": "busy", "status": 503, "retry_after": self.busy_reports[attempt_id]}
        if attempt_id in self.stale_shards:
            self.refused_stale[attempt_id] += 1
            return 409, {"title": "Conflict", "status": 409, "detail": "stale attempt"}
        if kind == "events":
            batch = WorkerEventBatch.model_validate_json(body)
            self.senders[attempt_id].add((batch.fencing_token, batch.node_rank))
            self.events[attempt_id].extend(batch.events)
            self.arrivals[attempt_id].extend(f"event:{ev.kind}" for ev in batch.events)
            return 200, WorkerEventAck(accepted=len(batch.events)).model_dump(mode="json")
        report = ShardReport.model_validate_json(body)
        for shard in report.shards:
            if shard.key in self.conflicting_keys:  # the whole batch is refused, as one transaction
                detail = f"shard key {shard.key!r} is not under this attempt's prefix"
                return 409, {"type": CONFLICT_TYPE, "title": "Conflict", "status": 409, "detail": detail}
        self.shard_batches[attempt_id].append(len(report.shards))
        self.senders[attempt_id].add((report.fencing_token, report.node_rank))
        have = {(s.step, s.rank) for s in self.shards[attempt_id]}
        for shard in report.shards:
            if (shard.step, shard.rank) not in have:  # keyed by (attempt, step, rank): stored once
                self.shards[attempt_id].append(shard)
                have.add((shard.step, shard.rank))
            self.arrivals[attempt_id].append(f"shard:{shard.step}:{shard.rank}")
        complete = sorted(
            step for step in {s.step for s in report.shards}
            if sum(1 for s in self.shards[attempt_id] if s.step == step) == report.shards[0].world_size
        )
        return 200, ShardAck(accepted=len(report.shards), committed_steps=complete).model_dump(mode="json")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        plane = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                match = re.match(r"^/v1/agent/attempts/([^/]+)/code$", self.path)
                data = plane.code.get(match.group(1)) if match and token in plane.tokens else None
                if data is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/gzip")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                piece = -(-len(data) // 16)
                for start in range(0, len(data), piece):
                    self.wfile.write(data[start:start + piece])
                    self.wfile.flush()
                    time.sleep(plane.code_trickle_s / 16)  # the network's pace, not a wait for an event

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                token = self.headers.get("Authorization", "").removeprefix("Bearer ")
                status, payload = plane._handle(self.path, token, body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                ctype = "application/json" if status < 400 else "application/problem+json"
                self.send_header("Content-Type", ctype)
                if status == 503 and "retry_after" in payload:
                    self.send_header("Retry-After", str(payload["retry_after"]))
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
