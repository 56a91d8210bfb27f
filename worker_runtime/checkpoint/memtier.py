"""The worker's side of the in-memory checkpoint tier (trainyard/protocol/memtier.py,
docs/architecture.md "In-memory checkpoint tier").

After a shard is uploaded to S3, ``AgentMemory.put`` hands the same bytes to the node agent, which
keeps them (so they outlive this process) and pushes a copy to a peer node. A restore asks
``get`` for a shard by its sha256, tier by tier (``local``: the agent's memory, ``peer``: a peer
agent's, through the agent); the restore verifies every answer against the manifest and reads S3
when none is right. Every failure here is a miss: the tier only ever makes a restore faster.
"""

from __future__ import annotations

import http.client
import logging
from typing import Protocol
from urllib.parse import urlsplit

import httpx

from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.memtier import (
    LOCAL_MEMORY_KIND,
    TOKEN_HEADER,
    MemoryStatus,
    UnixHTTPConnection,
    chunks,
    fill,
    get_body,
)
from worker_runtime.agent_http import socket_client
from worker_runtime.context import WorkerContext

log = logging.getLogger(__name__)

MIN_BYTES_PER_S = 50 * 1024 * 1024
"""A transfer to or from the agent may take 10 s plus its size at this rate."""


class MemorySource(Protocol):
    def get(self, rank: int, sha256: str, tier: str) -> bytes | bytearray | None:
        """The shard with these bytes from ``tier``, or None (a miss: read the next tier)."""
        ...


class AgentMemory:
    """The memory tier through this attempt's agent (its local API socket)."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        base = (ctx.agent_url or "").rstrip("/")
        self._base = f"{base}{LOCAL_API_PREFIX}/attempts/{ctx.attempt_id}/{LOCAL_MEMORY_KIND}"
        self._status: MemoryStatus | None = None

    @classmethod
    def of(cls, ctx: WorkerContext) -> AgentMemory | None:
        """None outside an agent (no local API to ask), and for a job that turned the tier off
        (``checkpoint.memory_tier: false``: no shard is handed over, every restore reads S3)."""
        if ctx.checkpoint.get("memory_tier") is False:
            return None
        return cls(ctx) if ctx.agent_url and ctx.attempt_id else None

    def _headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: self.ctx.fencing_token or ""}

    def status(self) -> MemoryStatus:
        """Whether the agent keeps shards for this attempt (asked once; off when it cannot say)."""
        if self._status is None:
            try:
                with socket_client(self.ctx.agent_socket, 10.0) as client:
                    answer = client.get(self._base, headers=self._headers())
                self._status = (MemoryStatus.model_validate_json(answer.content) if answer.status_code == 200
                                else MemoryStatus(enabled=False))
            except (httpx.HTTPError, ValueError) as exc:
                log.info("memory tier unavailable: %s", exc)
                self._status = MemoryStatus(enabled=False)
        return self._status

    def put(self, rank: int, sha256: str, data: bytes) -> bool:
        """Hand a shard just uploaded to the agent; False when it was not kept (never raises)."""
        size = len(data)
        if not self.status().enabled or size > self.status().budget_bytes:
            return False
        try:
            # The agent answers once it kept the bytes and its peer has its copy (or 5 s + transfer).
            with socket_client(self.ctx.agent_socket, 15.0 + 2 * size / MIN_BYTES_PER_S) as client:
                headers = {**self._headers(), "Content-Type": "application/octet-stream", "Content-Length": str(size)}
                answer = client.put(f"{self._base}/{rank}/{sha256}", content=chunks(data), headers=headers)
        except httpx.HTTPError as exc:
            log.info("shard not handed to the memory tier: %s", exc)
            return False
        if answer.status_code != 201:
            log.info("the agent did not keep the shard in memory: %s %s", answer.status_code, answer.text[:200])
            return False
        return True

    def get(self, rank: int, sha256: str, tier: str) -> bytearray | None:
        """The shard's bytes as the agent gave them (the caller verifies them), or None."""
        status = self.status()
        if not status.enabled:
            return None
        timeout = 10.0 + status.budget_bytes / MIN_BYTES_PER_S
        url = f"{self._base}/{rank}/{sha256}?tier={tier}"
        if self.ctx.agent_socket:
            # Straight into one buffer at memory speed (httpx would copy it chunk by chunk).
            try:
                conn = UnixHTTPConnection(self.ctx.agent_socket, timeout)
                return get_body(conn, f"{urlsplit(url).path}?tier={tier}", self._headers(), status.budget_bytes)
            except (OSError, http.client.HTTPException) as exc:
                log.info("memory tier %s unavailable: %s", tier, exc)
                return None
        try:
            with socket_client(None, timeout) as client, client.stream("GET", url, headers=self._headers()) as answer:
                size = answer.headers.get("Content-Length", "")
                if answer.status_code != 200 or not size.isdigit() or int(size) > status.budget_bytes:
                    return None
                return fill(answer.iter_raw(), int(size))
        except httpx.HTTPError as exc:
            log.info("memory tier %s unavailable: %s", tier, exc)
            return None

