"""The agent's side of the in-memory checkpoint tier (trainyard/protocol/memtier.py for the wire,
docs/architecture.md "In-memory checkpoint tier" for why).

``MemoryTier`` holds the node's ShardStore and serves three callers:
- the attempt's own workers, through the local API (local_api.py): ``put`` a shard just uploaded,
  ``get`` a shard by sha256 from this agent's memory or from a peer agent;
- peer agents, over TCP (TLS when the agent has a node certificate) on the memory port
  (memtier_peer.py): ``PUT``/``GET /v1/peer/jobs/<job>/shards/<rank>/<sha256>`` with
  ``Authorization: Bearer <job memory secret>``;
- itself: after a worker's ``put`` it pushes the copy to the part's peer in the background (the
  latest shard per job and rank only: a push still queued when a newer save arrives is dropped).

A peer request without a credential gets 401; an entry is found only with the secret that stored it
(memstore.py), so another job's secret, or a guess, finds nothing (404), exactly like a shard that
was never there. Every failure here is a miss for the worker, which then reads S3.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import httpx
import structlog

from node_agent.memstore import ShardStore, owner_of
from trainyard.protocol.memtier import PEER_PREFIX, MemoryTierSpec, chunks, get_body

log = structlog.get_logger(__name__)

PEER_TIMEOUT_S = 30.0
"""One peer request; a peer that takes longer is treated as gone (the worker reads S3)."""
_CHUNK = 4 * 1024 * 1024


@dataclass(frozen=True)
class AttemptMemory:
    """What the agent knows of one attempt part's memory tier (from its LaunchSpec)."""

    job_id: str
    secret: str
    peer_url: str | None = None
    sources: tuple[str, ...] = ()

    @classmethod
    def of(cls, job_id: str, spec: MemoryTierSpec | None) -> AttemptMemory | None:
        if spec is None:
            return None
        return cls(job_id, spec.secret, spec.peer_url, tuple(u for u in spec.sources if u != spec.peer_url))

    @property
    def owner(self) -> str:
        return owner_of(self.secret)


@dataclass
class _Pushes:
    """Pushes waiting for the push thread, newest per (job, rank, peer) only."""

    queue: OrderedDict[tuple[str, int, str], tuple[AttemptMemory, str, bytes | bytearray, threading.Event]] = field(
        default_factory=OrderedDict)
    cond: threading.Condition = field(default_factory=threading.Condition)
    stopped: bool = False
    busy: bool = False
    """A push is in flight."""


class MemoryTier:
    def __init__(self, budget_bytes: int, *, peer_timeout_s: float = PEER_TIMEOUT_S,
                 peer_tls: ssl.SSLContext | None = None, require_tls: bool = False) -> None:
        self.store = ShardStore(budget_bytes)
        self.peer_timeout_s = peer_timeout_s
        self.peer_tls = peer_tls
        """What an https:// peer's certificate is verified against (the cluster's CA: the agent's
        --ca-file); None: the system's trust store. Plain http:// peers are reached without TLS."""
        self.require_tls = require_tls
        """An agent whose own port speaks TLS neither sends nor asks for shards (nor the job's secret)
        over plain HTTP: an http:// peer is a miss."""
        self._pushes = _Pushes()
        self._pusher: threading.Thread | None = None
        self.pushed = 0
        self.push_failures = 0

    @property
    def enabled(self) -> bool:
        return self.store.budget_bytes > 0

    # --- workers (through the local API) ---

    def put(self, memory: AttemptMemory, rank: int, sha256: str, data: bytes | bytearray,
            *, wait_peer_s: float = 0.0) -> None:
        """Keep the shard and queue its push to the peer, waiting up to ``wait_peer_s`` for the push
        to be over (done, failed or superseded); raises ShardRefused."""
        self.store.put(memory.owner, memory.job_id, rank, sha256, data)
        if memory.peer_url and self._allowed(memory.peer_url):
            done = self._queue_push(memory, rank, sha256, data)
            if wait_peer_s > 0:
                done.wait(wait_peer_s)

    def get(self, memory: AttemptMemory, rank: int, sha256: str, tier: str) -> bytes | bytearray | None:
        """The shard's bytes from this agent's memory (``local``) or a peer's (``peer``), or None."""
        if tier == "local":
            # By content, whatever rank stored it: torchrun may give a rank another node this time,
            # and this agent may hold the bytes as another node's peer.
            entry = self.store.get(memory.owner, memory.job_id, sha256)
            return None if entry is None else entry.data
        for url in (memory.peer_url, *memory.sources):
            if url and self._allowed(url):
                data = self._fetch(url, memory, rank, sha256)
                if data is not None:
                    return data
        return None

    # --- peers ---

    def _allowed(self, url: str) -> bool:
        if self.require_tls and not url.startswith("https://"):
            log.warning("memory_peer_not_tls", peer=url[:200], detail="this agent talks to peers over TLS only")
            return False
        return True

    def _tls(self) -> ssl.SSLContext:
        if self.peer_tls is None:
            self.peer_tls = ssl.create_default_context()  # once: it reads the system's trust store
        return self.peer_tls

    def _peer_url(self, base: str, memory: AttemptMemory, rank: int, sha256: str) -> str:
        return f"{base.rstrip('/')}{PEER_PREFIX}/{memory.job_id}/shards/{rank}/{sha256}"

    def _fetch(self, base: str, memory: AttemptMemory, rank: int, sha256: str) -> bytearray | None:
        url = urlsplit(self._peer_url(base, memory, rank, sha256))
        try:
            # http.client reads the body straight into one buffer (httpx would copy it chunk by chunk).
            conn = (http.client.HTTPSConnection(url.hostname or "", url.port, timeout=self.peer_timeout_s,
                                                context=self._tls())
                    if url.scheme == "https" else
                    http.client.HTTPConnection(url.hostname or "", url.port, timeout=self.peer_timeout_s))
            data = get_body(conn, url.path, {"Authorization": f"Bearer {memory.secret}"}, self.store.budget_bytes)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.info("memory_peer_unreachable", peer=base, error=str(exc)[:200])
            return None
        # Not hashed here: the worker checks every byte against the committed manifest anyway, and a
        # second pass over a 2 GB shard costs a second.
        return data

    def _queue_push(self, memory: AttemptMemory, rank: int, sha256: str, data: bytes | bytearray) -> threading.Event:
        """Queue the push; the event is set once it is over (done, failed, or replaced by a newer one)."""
        assert memory.peer_url is not None
        pushes = self._pushes
        done = threading.Event()
        with pushes.cond:
            if pushes.stopped:
                done.set()
                return done
            key = (memory.job_id, rank, memory.peer_url)
            older = pushes.queue.pop(key, None)
            if older is not None:
                older[3].set()  # superseded: its shard is no longer the newest of that rank
            pushes.queue[key] = (memory, sha256, data, done)
            if self._pusher is None:
                self._pusher = threading.Thread(target=self._push_loop, name="memory-tier-push", daemon=True)
                self._pusher.start()
            pushes.cond.notify()
        return done

    def _push_loop(self) -> None:
        pushes = self._pushes
        while True:
            with pushes.cond:
                while not pushes.queue and not pushes.stopped:
                    pushes.cond.wait()
                if pushes.stopped:
                    return
                (job_id, rank, url), (memory, sha256, data, done) = pushes.queue.popitem(last=False)
                pushes.busy = True
            try:
                with httpx.Client(timeout=self.peer_timeout_s, trust_env=False, verify=self._tls()) as client:
                    answer = client.put(self._peer_url(url, memory, rank, sha256), content=chunks(data),
                                        headers={"Authorization": f"Bearer {memory.secret}",
                                                 "Content-Type": "application/octet-stream",
                                                 "Content-Length": str(len(data))})
                ok = answer.status_code == HTTPStatus.CREATED
                detail = "" if ok else answer.text[:200]
            except httpx.HTTPError as exc:
                ok, detail = False, str(exc)[:200]
            with pushes.cond:
                if ok:
                    self.pushed += 1
                else:
                    self.push_failures += 1
                pushes.busy = False
            done.set()
            if not ok:
                log.info("memory_peer_push_failed", peer=url, job_id=job_id, rank=rank, error=detail)

    def wait_pushed(self, timeout: float) -> bool:
        """Tests and the bench: wait until every queued push is over (done or failed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._pushes.cond:
                if not self._pushes.queue and not self._pushes.busy:
                    return True
            time.sleep(0.01)
        return False

    def stop(self) -> None:
        with self._pushes.cond:
            self._pushes.stopped = True
            for *_, done in self._pushes.queue.values():
                done.set()
            self._pushes.queue.clear()
            self._pushes.cond.notify_all()


def read_exactly(stream: Any, length: int) -> bytearray:
    """``length`` bytes of ``stream`` in chunks (raises TimeoutError when it ends early)."""
    buffer = bytearray(length)
    view = memoryview(buffer)
    got = 0
    while got < length:
        n = stream.readinto(view[got:got + _CHUNK])
        if not n:
            raise TimeoutError("the body ended early")
        got += n
    return buffer  # not bytes(buffer): that would hold a shard twice


