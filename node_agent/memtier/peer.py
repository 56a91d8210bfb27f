"""The agent's memory port: the in-memory checkpoint tier served to peer agents (memtier/tier.py for the
tier, docs/architecture.md "In-memory checkpoint tier").

    PUT /v1/peer/jobs/<job>/shards/<rank>/<sha256>   shard bytes -> 201
    GET /v1/peer/jobs/<job>/shards/<rank>/<sha256>   -> 200 bytes, 404

with ``Authorization: Bearer <memory grant>``: the control plane's grant of that job for this node
(trainyard/protocol/memtier.py ``memory_grant``, checked by ``MemoryTier.accepts``). Any other bearer
(a guess, another job's grant, this job's grant for another node) gets 401 and neither reads, stores
nor evicts anything; a granted job stores within its share and evicts only its own entries
(memtier/store.py). The port is reachable by any host that can reach
the node, so it is bounded like the local API (connections.py; PeerLimits): at most
``connections_total`` connections are served at once and ``connections_per_peer`` from one address
(503 beyond, answered without a thread); the request line and headers must arrive within
``request_timeout_s`` and a body within that plus its size at MIN_BYTES_PER_S (408, then closed);
a body is read only under a reservation from the tier's in-flight budget, shared with the local
API's puts (MemoryTier.reserve: 413 over the job's share, 503 while the budget is taken), and is
allocated as it arrives; a GET's answer is held under the same budget until it is taken
(MemoryTier.reserve_answer: 503 beyond it): a host that opens connections, or trickles bytes, or
announces huge bodies, or leaves answers unread, costs the agent a bounded number of threads and
bytes, and a peer from another address is still served. One request per connection.

With a node certificate (``--memory-tls-cert``/``--memory-tls-key``) the port speaks TLS only, and
peers verify it against the cluster's CA (their ``--ca-file``); the handshake runs on the
connection's own thread, under the same deadline. Without one the agent serves no memory port at all
unless its operator passed ``--memory-plain-http`` (node_agent/config.py), which it logs as a
warning: grants and shards would cross the network in clear.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import socketserver
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote

import structlog

from node_agent.local.connections import DeadlineReader, Gate, KeyedGates, SocketWriter, problem_bytes, refuse
from node_agent.memtier.store import ShardRefused, job_owner
from node_agent.memtier.tier import MemoryTier, read_exactly
from trainyard.protocol.memtier import JOB_ID_RE, PEER_PREFIX, parse_rank, valid_sha256

log = structlog.get_logger(__name__)

MIN_BYTES_PER_S = 50 * 1024 * 1024
"""A shard body may take request_timeout_s plus its size at this rate, to arrive or to be read."""


@dataclass(frozen=True, kw_only=True)
class PeerLimits:
    request_timeout_s: float = 10.0
    """The TLS handshake, request line and headers must arrive within this; a body gets this plus its
    size at MIN_BYTES_PER_S, and so does an answer to be taken."""
    connections_total: int = 64
    """Connections served at once (each holds a thread)."""
    connections_per_peer: int = 16
    """Of those, from one address: a host flooding the port leaves room for the others. A node's ranks
    restoring at once each fetch through their agent: 16 covers a node of 8 GPUs twice over (beyond
    it a fetch is a miss and reads S3)."""
    inflight_bytes: int | None = None
    """Lowers the tier's in-flight budget (MemoryTier.inflight_bytes, shared with the local API's puts and answers);
    None: the tier's as it is."""

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if not 1 <= self.connections_per_peer <= self.connections_total:
            raise ValueError("need 1 <= connections_per_peer <= connections_total")
        if self.inflight_bytes is not None and self.inflight_bytes < 1:
            raise ValueError("inflight_bytes must be >= 1")


class _PeerHandler(BaseHTTPRequestHandler):
    server: PeerServer  # type: ignore[assignment]
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.connection = self.request
        self.reader = DeadlineReader(self.connection, self.server.request_deadline())
        self.rfile = io.BufferedReader(self.reader)
        self.writer = SocketWriter(self.connection)
        self.wfile = self.writer
        self.answered = False

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        if self.reader.expired and not self.answered:
            # The request did not arrive whole in time (the stdlib drops the connection silently).
            with contextlib.suppress(OSError):
                self.connection.settimeout(1.0)
                self.connection.sendall(problem_bytes(HTTPStatus.REQUEST_TIMEOUT, "the request did not arrive in "
                                                      "time"))

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def _answer(self, status: HTTPStatus, detail: str = "", body: bytes | bytearray | None = None) -> None:
        self.answered = True
        if body is None:
            body = json.dumps({"type": "about:blank", "title": status.phrase, "status": int(status),
                               "detail": detail[:500]}).encode()
            kind = "application/problem+json" if status >= 400 else "application/json"
        else:
            kind = "application/octet-stream"
        # The answer must be taken in time too: a peer that reads slowly cannot hold the thread.
        self.writer.deadline = time.monotonic() + self.server.limits.request_timeout_s + len(body) / MIN_BYTES_PER_S
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _target(self) -> tuple[str, int, str, str] | None:
        """(job, rank, sha256, owner) of a well-formed request with the job's grant; None: answered."""
        parts = self.path.partition("?")[0].split("/")
        # "", v1, peer, jobs, <job>, shards, <rank>, <sha256>
        if len(parts) != 8 or "/".join(parts[:4]) != PEER_PREFIX or parts[5] != "shards":
            self._answer(HTTPStatus.NOT_FOUND, f"no route {self.path[:200]}")
            return None
        job_id, rank, sha = unquote(parts[4]), parse_rank(parts[6]), parts[7]
        if not JOB_ID_RE.fullmatch(job_id) or rank is None or not valid_sha256(sha):
            self._answer(HTTPStatus.UNPROCESSABLE_ENTITY, "the job id, rank or sha256 in the path is malformed")
            return None
        auth = self.headers.get("Authorization") or ""
        scheme, _, secret = auth.partition(" ")
        if scheme.lower() != "bearer" or not self.server.tier.accepts(job_id, secret.strip()):
            self._answer(HTTPStatus.UNAUTHORIZED, "the control plane's memory grant of this job for this node is "
                         "required (Authorization: Bearer)")
            return None
        self.server.tier.touch(job_id)
        return job_id, rank, sha, job_owner(job_id)

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        target = self._target()
        if target is None:
            return
        job_id, rank, sha, owner = target
        tier = self.server.tier
        entry = tier.store.get(owner, job_id, sha)  # by content, like a local read
        if entry is None:
            self._answer(HTTPStatus.NOT_FOUND, "no such shard here for this credential")
            return
        # Counted until it is taken (or its deadline passes), as a worker's answer is: a peer that
        # stops reading keeps the entry alive past its eviction (issue 23 review, finding 4).
        refused = tier.reserve_answer(job_id, len(entry.data))
        if refused is not None:
            self._answer(refused.status, refused.detail)
            return
        try:
            self._answer(HTTPStatus.OK, body=entry.data)
        finally:
            tier.release(job_id, len(entry.data))

    def _drain(self) -> None:
        """Read and drop the body of a PUT answered before it was read (401, 404, 422), up to
        DRAIN_MAX_BYTES within the request's deadline: closing a socket with bytes still unread sends a
        reset, which can reach the sender before the answer and turn a 401 into "connection reset"."""
        text = (self.headers.get("Content-Length") or "").strip()
        left = min(int(text), DRAIN_MAX_BYTES) if text.isdigit() and len(text) <= 20 else 0
        with contextlib.suppress(Exception):  # a sender that stops or lies: its connection just closes
            while left > 0 and (chunk := self.rfile.read1(min(left, 64 << 10))):
                left -= len(chunk)

    def do_PUT(self) -> None:  # noqa: N802 - stdlib naming
        target = self._target()
        if target is None:
            self._drain()
            return
        job_id, rank, sha, owner = target
        text = (self.headers.get("Content-Length") or "").strip()
        if self.headers.get("Transfer-Encoding") or not text.isdigit() or len(text) > 20:
            self._answer(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required")
            return
        length, tier = int(text), self.server.tier
        refused = tier.reserve(job_id, length)
        if refused is not None:
            self._answer(refused.status, refused.detail)
            self._drain()
            return
        try:
            self.reader.deadline += length / MIN_BYTES_PER_S
            data = read_exactly(self.rfile, length)
            tier.store_shard(job_id, rank, sha, data)
        except ShardRefused as exc:
            self._answer(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc))
            return
        finally:
            tier.release(job_id, length)
        self._answer(HTTPStatus.CREATED, "stored")


DRAIN_MAX_BYTES = 1 << 20
"""The most of a refused PUT's body the server reads and drops so that its answer arrives whole."""


class PeerServer(socketserver.TCPServer):
    """The agent's memory port: serves this agent's MemoryTier to peer agents (module docstring).
    ``tls``: a server context holding the node's certificate; None: plain HTTP."""

    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, tier: MemoryTier, host: str, port: int, *, limits: PeerLimits | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.tier = tier
        self.limits = limits or PeerLimits()
        self.tls = tls
        self.active = Gate(self.limits.connections_total)
        self.per_peer = KeyedGates(self.limits.connections_per_peer)
        if self.limits.inflight_bytes is not None:
            tier.inflight_bytes = min(tier.inflight_bytes, self.limits.inflight_bytes)
        self._connection = threading.local()
        self._lock = threading.Lock()
        self.serving = 0
        """Connections being served now (each on its own thread)."""
        super().__init__((host, port), _PeerHandler)
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="memory-tier-peer", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    def request_deadline(self) -> float:
        """When the request of the connection this thread serves must have arrived (from its accept)."""
        accepted = getattr(self._connection, "accepted", None) or time.monotonic()
        return float(accepted) + self.limits.request_timeout_s

    def process_request(self, request: Any, client_address: Any) -> None:
        host = str(client_address[0])
        if not self.active.acquire():
            refuse(request)
            return
        if not self.per_peer.acquire(host):
            self.active.release()
            refuse(request)
            return
        with self._lock:
            self.serving += 1
        threading.Thread(target=self._serve, args=(request, client_address, host, time.monotonic()),
                         name="memory-peer-conn", daemon=True).start()

    def _serve(self, request: socket.socket, client_address: Any, host: str, accepted: float) -> None:
        conn = request
        self._connection.accepted = accepted
        try:
            if self.tls is not None:
                # On this thread, not the accept loop's, and within the request's deadline: a client
                # that never finishes its handshake holds one bounded slot, not the port.
                request.settimeout(max(0.001, self.request_deadline() - time.monotonic()))
                conn = self.tls.wrap_socket(request, server_side=True)
            _PeerHandler(conn, client_address, self)
        except Exception as exc:  # a broken connection costs its own request only
            log.info("memory_peer_request_failed", peer=host[:100], error=str(exc)[:200])
        finally:
            with self._lock:
                self.serving -= 1
            with contextlib.suppress(OSError):
                conn.close()
            with contextlib.suppress(OSError):
                request.close()
            self.per_peer.release(host)
            self.active.release()

    def start(self) -> PeerServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()
        self.server_close()


@contextlib.contextmanager
def serving(tier: MemoryTier, host: str = "127.0.0.1", port: int = 0, *, limits: PeerLimits | None = None,
            tls: ssl.SSLContext | None = None) -> Iterator[PeerServer]:
    server = PeerServer(tier, host, port, limits=limits, tls=tls).start()
    try:
        yield server
    finally:
        server.stop()
        tier.stop()
