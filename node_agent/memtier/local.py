"""The local API's routes of the in-memory checkpoint tier (a worker and its own agent):

    GET /v1/local/attempts/{attempt_id}/memory                      -> 200 MemoryStatus
    PUT /v1/local/attempts/{attempt_id}/memory/{rank}/{sha256}      shard bytes -> 201
    GET /v1/local/attempts/{attempt_id}/memory/{rank}/{sha256}?tier=local|peer -> 200 bytes, 404

Fenced like every local request: the attempt's fencing token goes in X-Trainyard-Fencing-Token (the
body is the shard itself, not JSON), 409 when it is wrong or the attempt is not here. The job and
the credential come from the attempt's LaunchSpec (AttemptMemory), never from the worker: a worker
can only store and read its own job's shards. The bodies are binary and as large as a shard, so
these routes take a body up to the job's share of the memory budget (not the API's JSON limit), read
only under a reservation from the tier's in-flight budget (memtier/tier.py: 413 over the share, 503 while
the budget is taken, nothing allocated before the bytes arrive), and allow it time in proportion to
its size. An answer (a stored shard, or one fetched from a peer) is counted the same way until it
is sent (``MemoryTier.lend``): 503 when it would not fit.
"""

from __future__ import annotations

import re
import time
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, unquote

import structlog

from node_agent.memtier.store import ShardRefused
from node_agent.memtier.tier import Refusal, read_exactly
from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.memtier import LOCAL_MEMORY_KIND, TIER_HEADER, TIERS, TOKEN_HEADER, MemoryStatus, parse_rank

log = structlog.get_logger(__name__)

MEMORY_ROUTE = re.compile(
    rf"^{re.escape(LOCAL_API_PREFIX)}/attempts/(?P<attempt_id>[^/]+)/{LOCAL_MEMORY_KIND}"
    r"(?:/(?P<rank>[^/]+)/(?P<sha256>[^/]+))?$"
)
MIN_BYTES_PER_S = 50 * 1024 * 1024
"""A shard body may take request_timeout_s plus its size at this rate to arrive."""


def serve_memory(handler: Any, match: re.Match[str]) -> None:
    """Answer one memory request on ``handler`` (local_api._Handler); never raises for bad input."""
    ctx = handler.server
    attempt_id = unquote(match["attempt_id"])
    if attempt_id != ctx.attempt_id:
        handler._problem(HTTPStatus.FORBIDDEN, "this socket serves its own attempt only")
        return
    token = handler.headers.get(TOKEN_HEADER) or ""
    if not ctx.reports.accepts(attempt_id, token):
        handler._fenced_off(attempt_id, LOCAL_MEMORY_KIND)
        return
    tier, memory = ctx.memory, ctx.attempt_memory
    enabled = tier is not None and tier.enabled and memory is not None
    if match["rank"] is None:
        if handler.command != "GET":
            handler._problem(HTTPStatus.METHOD_NOT_ALLOWED, "GET the memory tier's status")
            return
        status = MemoryStatus(enabled=enabled, budget_bytes=tier.store.budget_bytes if enabled and tier else 0,
                              peer=bool(enabled and memory and memory.peer_url))
        handler._send(HTTPStatus.OK, status.model_dump(), "application/json")
        return
    rank, sha = parse_rank(match["rank"]), match["sha256"]
    if rank is None or not re.fullmatch(r"[0-9a-f]{64}", sha):
        handler._problem(HTTPStatus.UNPROCESSABLE_ENTITY,
                         "rank must be a non-negative integer and sha256 64 hex digits")
        return
    if not enabled:
        handler._problem(HTTPStatus.NOT_FOUND, "the in-memory checkpoint tier is off for this attempt")
        return
    assert tier is not None and memory is not None
    if handler.command == "PUT":
        _put(handler, tier, memory, rank, sha)
        return
    which = (parse_qs(handler.path.partition("?")[2]).get("tier") or ["local"])[-1]
    if which not in TIERS:
        handler._problem(HTTPStatus.UNPROCESSABLE_ENTITY, f"tier must be one of {', '.join(TIERS)}")
        return
    # The answer's bytes stay counted against the in-flight budget and the job's share until they
    # are sent or the send gives up (request_timeout_s plus the size at MIN_BYTES_PER_S): a worker
    # that opens GETs and never reads them holds at most its share (issue 23 review, finding 4).
    with tier.lend(memory, rank, sha, which) as data:
        if data is None:
            handler._problem(HTTPStatus.NOT_FOUND, f"no shard {sha[:12]}... of rank {rank} in the {which} tier")
            return
        if isinstance(data, Refusal):
            handler._problem(data.status, data.detail)
            return
        handler.close_connection = True
        handler.connection.settimeout(ctx.limits.request_timeout_s + len(data) / MIN_BYTES_PER_S)
        handler.send_response(HTTPStatus.OK)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header(TIER_HEADER, which)
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)


def _put(handler: Any, tier: Any, memory: Any, rank: int, sha: str) -> None:
    text = (handler.headers.get("Content-Length") or "").strip()
    if not text.isdigit() or len(text) > 20:
        handler._problem(HTTPStatus.LENGTH_REQUIRED, "a Content-Length (a byte count) is required")
        return
    length = int(text)
    # Reserved before a byte of the body is read, released on every path (memtier/tier.py, finding 5 of
    # issue 23): a worker that announces more than its job's share, or while the in-flight budget is
    # taken, is refused at once and keeps its shard in S3 only.
    refused = tier.reserve(memory.job_id, length)
    if refused is not None:
        handler._problem(refused.status, refused.detail)
        return
    try:
        handler.reader.deadline = (time.monotonic() + handler.server.limits.request_timeout_s
                                   + length / MIN_BYTES_PER_S)
        data = read_exactly(handler.rfile, length)
        # The worker reports its shard after this answer: waiting for the peer's copy (bounded)
        # means a committed checkpoint is in two memories unless the peer is slow or gone.
        tier.put(memory, rank, sha, data, wait_peer_s=min(tier.peer_timeout_s, 5.0 + length / MIN_BYTES_PER_S))
    except ShardRefused as exc:
        handler._problem(HTTPStatus.UNPROCESSABLE_ENTITY, str(exc))
        return
    finally:
        tier.release(memory.job_id, length)
    log.debug("memory_shard_stored", job_id=memory.job_id, rank=rank, bytes=length)
    handler._send(HTTPStatus.CREATED, {"stored": True, "peer": bool(memory.peer_url)}, "application/json")


