"""The agent's side of the in-memory checkpoint tier (trainyard/protocol/memtier.py for the wire,
docs/architecture.md "In-memory checkpoint tier" for why).

``MemoryTier`` holds the node's ShardStore and serves three callers:
- the attempt's own workers, through the local API (local/api.py): ``put`` a shard just uploaded,
  ``get`` a shard by sha256 from this agent's memory or from a peer agent;
- peer agents, over TCP (TLS unless the operator opted out) on the memory port (memtier/peer.py):
  ``PUT``/``GET /v1/peer/jobs/<job>/shards/<rank>/<sha256>`` with ``Authorization: Bearer <grant>``,
  the job's grant for this node (trainyard/protocol/memtier.py ``memory_grant``; ``accepts``);
- itself: after a worker's ``put`` it pushes the copy to the part's peer in the background (the
  latest shard per job and rank only: a push still queued when a newer save arrives is dropped),
  with the grant the part's spec holds for that peer.

A peer request without a job's grant for this node gets 401 and touches nothing. Every failure here
is a miss for the worker, which then reads S3.

Memory (issue 23, finding 5): a body is read only under a **reservation** of its declared length
(``reserve``): all bodies being received at once, local and peer together, hold at most
``inflight_bytes`` (a shard fetched from a peer for a worker is received under it too), and one
job's at most its share; the bytes are allocated as they arrive, never
the declared length up front. A job's **share** is the budget split evenly among the jobs this
agent serves now (those that stored or asked for a shard here within JOB_IDLE_S); it bounds what the
job stores (memtier/store.py evicts the job's own oldest to stay within it) and what it may have in
flight. A request that does not fit is refused (413 over the share, 503 while the budget is taken)
and the worker keeps its S3 copy only. An **answer** is counted the same way until it is sent
(``lend``; issue 23 review, finding 4): a stored shard sent to a worker or a peer (which a later save
may evict from the store, but not from memory while a send holds it) and a shard fetched from a peer
for a worker (received and then answered under one reservation); one that does not fit is refused
with 503 and the worker reads S3. At most the budget is stored and the in-flight budget being
received or answered, whatever workers and peers announce or leave unread.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

import httpx
import structlog

from node_agent.memtier.store import ShardStore, job_owner
from trainyard.protocol.memtier import PEER_PREFIX, MemoryTierSpec, chunks, get_body, memory_grant

log = structlog.get_logger(__name__)

PEER_TIMEOUT_S = 30.0
"""One peer request; a peer that takes longer is treated as gone (the worker reads S3)."""
_CHUNK = 4 * 1024 * 1024
_ZEROS = bytes(_CHUNK)
JOB_IDLE_S = 3600.0
"""A job that neither stored nor asked for a shard here for this long no longer counts among the jobs
sharing the budget, and its entries go at the next store (its attempts are over, or it saves less
often than this: its copy would be stale anyway)."""


@dataclass(frozen=True)
class AttemptMemory:
    """What the agent knows of one attempt part's memory tier (from its LaunchSpec)."""

    job_id: str
    secret: str
    peer_url: str | None = None
    sources: tuple[str, ...] = ()
    grants: Mapping[str, str] = field(default_factory=dict)
    """Peer URL -> the job's grant at that agent (the bearer it accepts); a URL without one is not asked."""

    @classmethod
    def of(cls, job_id: str, spec: MemoryTierSpec | None) -> AttemptMemory | None:
        if spec is None:
            return None
        return cls(job_id, spec.secret, spec.peer_url, tuple(u for u in spec.sources if u != spec.peer_url),
                   dict(spec.grants))

    @property
    def owner(self) -> str:
        return job_owner(self.job_id)


@dataclass(frozen=True)
class Refusal:
    """Why a shard body is not read: the status and detail of the problem answered."""

    status: HTTPStatus
    detail: str


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
                 peer_tls: ssl.SSLContext | None = None, require_tls: bool = False,
                 inflight_bytes: int | None = None, grant_key: str | None = None) -> None:
        self.store = ShardStore(budget_bytes)
        self.inflight_bytes = max(1, budget_bytes if inflight_bytes is None else inflight_bytes)
        """Shard bytes being received or answered at once, local and peer requests together."""
        self.grant_key = grant_key
        """This node's grant key (memory_grant_key of its current credential: the agent sets it at each
        registration); None: no peer request is accepted."""
        self._inflight: dict[str, int] = {}
        self._jobs: dict[str, float] = {}
        """Job -> when it last stored or asked for a shard here (monotonic)."""
        self._lock = threading.Lock()
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
        self.store_shard(memory.job_id, rank, sha256, data)
        if memory.peer_url and self._allowed(memory.peer_url) and self._grant(memory, memory.peer_url):
            done = self._queue_push(memory, rank, sha256, data)
            if wait_peer_s > 0:
                done.wait(wait_peer_s)

    def get(self, memory: AttemptMemory, rank: int, sha256: str, tier: str) -> bytes | bytearray | None:
        """The shard's bytes from this agent's memory (``local``) or a peer's (``peer``), or None (a
        miss or a refusal). Once this returns, the bytes are no longer counted: an answer sent to a
        worker goes through ``lend`` instead."""
        with self.lend(memory, rank, sha256, tier) as got:
            return None if isinstance(got, Refusal) else got

    @contextlib.contextmanager
    def lend(self, memory: AttemptMemory, rank: int, sha256: str,
             tier: str) -> Iterator[bytes | bytearray | Refusal | None]:
        """The shard's bytes as ``get`` finds them, counted in the in-flight budget and the job's share
        until the block ends (the caller sends them inside it); a Refusal when answering them would
        go past either (the worker reads S3), None when no tier has them.

        Why (issue 23 review, finding 4): an answer the worker does not read holds its bytes for as
        long as the send may take. A local answer holds the stored entry, which a later save may
        evict from the store but not from memory; a peer's answer is a fresh copy per request. Held
        uncounted, a worker opening many GETs it never reads made the agent keep one copy each."""
        got, held = self._take(memory, rank, sha256, tier)
        try:
            yield got
        finally:
            if held:
                self.release(memory.job_id, held)

    def _take(self, memory: AttemptMemory, rank: int, sha256: str,
              tier: str) -> tuple[bytes | bytearray | Refusal | None, int]:
        """(what ``lend`` yields, the bytes reserved for it: the caller releases them)."""
        self.touch(memory.job_id)
        if tier == "local":
            # By content, whatever rank stored it: torchrun may give a rank another node this time,
            # and this agent may hold the bytes as another node's peer.
            entry = self.store.get(memory.owner, memory.job_id, sha256)
            if entry is None:
                return None, 0
            refused = self.reserve_answer(memory.job_id, len(entry.data))
            return (refused, 0) if refused is not None else (entry.data, len(entry.data))
        refusal: Refusal | None = None
        for url in (memory.peer_url, *memory.sources):
            if url and self._allowed(url) and self._grant(memory, url):
                data, held = self._fetch(url, memory, rank, sha256)
                if isinstance(data, Refusal):
                    refusal = data
                elif data is not None:
                    return data, held
        return refusal, 0

    # --- the budget: shares, reservations, grants ---

    def touch(self, job_id: str) -> None:
        with self._lock:
            self._jobs[job_id] = time.monotonic()

    def share_of(self, job_id: str) -> int:
        """The bytes ``job_id`` may store here (and have in flight): the budget over the jobs served
        now (seen within JOB_IDLE_S), the asking one included, which counts as seen now."""
        now = time.monotonic()
        with self._lock:
            self._jobs[job_id] = now
            for gone in [j for j, seen in self._jobs.items() if now - seen >= JOB_IDLE_S]:
                del self._jobs[gone]
            active = len(self._jobs)
        return self.store.budget_bytes // active

    def store_shard(self, job_id: str, rank: int, sha256: str, data: bytes | bytearray) -> None:
        """Keep a shard for ``job_id`` within its share, evicting only its own entries (and those
        of jobs idle past JOB_IDLE_S); raises ShardRefused."""
        share = self.share_of(job_id)
        self._expire_idle()
        self.store.put(job_owner(job_id), job_id, rank, sha256, data, share=share)

    def _expire_idle(self) -> None:
        with self._lock:
            active = set(self._jobs)
        for job_id in self.store.jobs() - active:
            self.store.drop_job(job_id)

    def reserve(self, job_id: str, length: int) -> Refusal | None:
        """Hold ``length`` bytes of the in-flight budget for a body of ``job_id`` about to be read;
        None when held (the caller must ``release`` it on every path), else why not."""
        share = self.share_of(job_id)
        if length > share:
            return Refusal(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                           f"a shard of {length} bytes is over this job's share of this agent's memory budget "
                           f"({share} of {self.store.budget_bytes} bytes)")
        with self._lock:
            mine = self._inflight.get(job_id, 0)
            total = sum(self._inflight.values())
            if mine + length > share or total + length > self.inflight_bytes:
                return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                               "too many shard bytes are being received or answered at once (this job's or all jobs')")
            self._inflight[job_id] = mine + length
        return None

    def reserve_answer(self, job_id: str, length: int) -> Refusal | None:
        """``reserve`` for an answer's bytes (a shard sent to a worker or a peer), held until it is
        sent; refused always as 503: the shard exists, the agent will not hold it for this request
        now (too much of this job's share, or of the budget, is being answered or received)."""
        refused = self.reserve(job_id, length)
        if refused is None:
            return None
        return Refusal(HTTPStatus.SERVICE_UNAVAILABLE,
                       f"not answered from memory now: {refused.detail} (read the shard from S3)")

    def release(self, job_id: str, length: int) -> None:
        with self._lock:
            left = self._inflight.get(job_id, 0) - length
            if left > 0:
                self._inflight[job_id] = left
            else:
                self._inflight.pop(job_id, None)

    @property
    def inflight_held(self) -> int:
        with self._lock:
            return sum(self._inflight.values())

    def accepts(self, job_id: str, bearer: str) -> bool:
        """Whether ``bearer`` is the control plane's grant of ``job_id`` for this node."""
        key = self.grant_key
        return key is not None and hmac.compare_digest(bearer.encode(), memory_grant(key, job_id).encode())

    def _grant(self, memory: AttemptMemory, url: str) -> str | None:
        grant = memory.grants.get(url)
        if grant is None:
            log.info("memory_peer_without_grant", peer=url[:200], job_id=memory.job_id)
        return grant

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

    def _fetch(self, base: str, memory: AttemptMemory, rank: int,
               sha256: str) -> tuple[bytearray | Refusal | None, int]:
        """(the peer's bytes, the bytes reserved for them: the caller releases them once it sent them
        on), (a Refusal, 0) when they would not fit, or (None, 0) on a miss."""
        url = urlsplit(self._peer_url(base, memory, rank, sha256))
        held = 0
        refused: Refusal | None = None

        def admit(size: int) -> bool:
            # Received and then answered under one reservation, decided on the announced length
            # before anything is allocated (finding 5), kept until the worker took the bytes (lend).
            nonlocal held, refused
            refused = self.reserve_answer(memory.job_id, size)
            if refused is not None:
                log.info("memory_peer_fetch_refused", peer=base, job_id=memory.job_id, bytes=size)
                return False
            held = size
            return True

        data: bytearray | None = None
        try:
            # http.client reads the body straight into one buffer (httpx would copy it chunk by chunk).
            conn = (http.client.HTTPSConnection(url.hostname or "", url.port, timeout=self.peer_timeout_s,
                                                context=self._tls())
                    if url.scheme == "https" else
                    http.client.HTTPConnection(url.hostname or "", url.port, timeout=self.peer_timeout_s))
            data = get_body(conn, url.path, {"Authorization": f"Bearer {memory.grants.get(base, '')}"},
                            self.store.budget_bytes, admit)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.info("memory_peer_unreachable", peer=base, error=str(exc)[:200])
        finally:
            if held and data is None:  # nothing to answer: the reservation goes with it
                self.release(memory.job_id, held)
                held = 0
        # Not hashed here: the worker checks every byte against the committed manifest anyway, and a
        # second pass over a 2 GB shard costs a second.
        return (data, held) if data is not None else (refused, 0)

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
                                        headers={"Authorization": f"Bearer {memory.grants.get(url, '')}",
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
    """``length`` bytes of ``stream`` (raises TimeoutError when it ends early). The buffer grows as the
    bytes arrive (issue 23, finding 5): a sender that announces 4 GiB and sends nothing costs nothing,
    and a shard still moves at memory speed (``readinto`` straight into the buffer; appending to a
    bytearray reallocates in place or by remapping, amortized)."""
    buffer = bytearray()
    zeros = memoryview(_ZEROS)
    while len(buffer) < length:
        start = len(buffer)
        want = min(_CHUNK, length - start)
        buffer += zeros[:want]
        with memoryview(buffer) as whole, whole[start:] as tail:
            n = stream.readinto(tail)
        if not n:
            raise TimeoutError("the body ended early")
        if n < want:
            del buffer[start + n:]
    return buffer  # not bytes(buffer): that would hold a shard twice
