"""The agent's bounded store of checkpoint shards in host memory (the in-memory tier's local copy;
trainyard/protocol/memtier.py, docs/architecture.md "In-memory checkpoint tier").

Held by the agent, not the worker, so that it outlives a killed rank. An entry is the bytes of one
shard, keyed by owner, job, rank and sha256; the owner is the job (``job_owner``): who may act for a
job is decided before the store (a local request by its attempt's LaunchSpec, a peer's by the job's
grant, memtier/peer.py). Only the latest ``keep_per_rank`` entries per (owner, job, rank) are kept:
two by default, the shard just saved (which may never be committed: another rank may die before it
saves) and the one before it (which then is the committed one a restore asks for).

**A job evicts only its own entries** (issue 23, finding 9): a put may take at most the job's
``share`` of the budget (the caller's: memtier/tier.py splits the budget among the jobs it serves), so
the job's oldest entries go first to keep it within that, and when the whole budget is taken by
other jobs' entries the put is refused (ShardRefused), never served by evicting them. A job that
held more than its share before others came shrinks on its own next save. The store is an
accelerator: nothing counts on an entry being there, and a restore always verifies what it gets
against the committed manifest.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass


class ShardRefused(ValueError):  # noqa: N818 - reads as the reason ("shard refused")
    """The shard cannot be stored (its bytes do not match its sha256, or it is over the budget)."""


def owner_of(secret: str) -> str:
    """What the store keeps of a credential: its digest, never the secret itself."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def job_owner(job_id: str) -> str:
    """The owner of a job's entries, whichever authorized path (local or peer) stored them: a node
    that keeps a copy as a peer finds it when it later runs that job's part itself."""
    return owner_of(f"job:{job_id}")


@dataclass(frozen=True)
class Entry:
    owner: str
    job_id: str
    rank: int
    sha256: str
    data: bytes | bytearray
    """Never written after it is stored."""
    stored_at: float


_Key = tuple[str, str, int, str]  # owner, job, rank, sha256
KEEP_PER_RANK = 2


class ShardStore:
    """Thread-safe; ``budget_bytes`` bounds the sum of the entries' sizes (0: stores nothing)."""

    def __init__(self, budget_bytes: int, *, keep_per_rank: int = KEEP_PER_RANK) -> None:
        if budget_bytes < 0 or keep_per_rank < 1:
            raise ValueError("budget_bytes must be >= 0 and keep_per_rank >= 1")
        self.budget_bytes = budget_bytes
        self.keep_per_rank = keep_per_rank
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Key, Entry] = OrderedDict()  # oldest first
        self._used = 0
        self.evictions = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def put(self, owner: str, job_id: str, rank: int, sha256: str, data: bytes | bytearray, *,
            verify: bool = True, share: int | None = None) -> list[Entry]:
        """Store ``data`` as the latest shard of (job, rank) for ``owner``; returns the entries
        evicted, all of (owner, job): the rank's oldest past keep_per_rank, then the job's oldest to
        keep it within ``share`` (None: the budget) and to make room. Raises ShardRefused when the
        bytes do not hash to ``sha256``, the shard alone is larger than the share, or other jobs'
        entries leave no room (nothing changes then)."""
        cap = self.budget_bytes if share is None else min(share, self.budget_bytes)
        if len(data) > cap:
            raise ShardRefused(f"a shard of {len(data)} bytes is over this job's share of this agent's memory "
                               f"budget ({cap} of {self.budget_bytes} bytes)")
        if verify and hashlib.sha256(data).hexdigest() != sha256:
            raise ShardRefused("the shard's bytes do not match its sha256")
        entry = Entry(owner, job_id, rank, sha256, data, time.monotonic())
        key = (owner, job_id, rank, sha256)
        with self._lock:
            ours = [k for k in self._entries if k[:2] == key[:2] and k != key]  # oldest first
            same_rank = [k for k in ours if k[2] == rank]
            going = same_rank[:max(0, len(same_rank) - self.keep_per_rank + 1)]
            kept = [k for k in ours if k not in going]
            used = self._used - sum(len(self._entries[k].data) for k in going)
            if key in self._entries:  # the same bytes again: now the newest
                used -= len(self._entries[key].data)
            mine = sum(len(self._entries[k].data) for k in kept)
            for k in kept:  # the job's own oldest, while it is over its share or the budget is full
                if mine + len(data) <= cap and used + len(data) <= self.budget_bytes:
                    break
                going.append(k)
                mine -= len(self._entries[k].data)
                used -= len(self._entries[k].data)
            if used + len(data) > self.budget_bytes:
                raise ShardRefused(f"this agent's memory budget of {self.budget_bytes} bytes is taken by other "
                                   "jobs' shards (a job never evicts another's)")
            evicted = [self._pop(k) for k in going]
            if key in self._entries:
                self._pop(key)
            self._entries[key] = entry
            self._used += len(data)
            self.evictions += len(evicted)
        return evicted

    def job_bytes(self, owner: str, job_id: str) -> int:
        with self._lock:
            return sum(len(e.data) for k, e in self._entries.items() if k[:2] == (owner, job_id))

    def _pop(self, key: _Key) -> Entry:
        gone = self._entries.pop(key)
        self._used -= len(gone.data)
        return gone

    def get(self, owner: str, job_id: str, sha256: str, rank: int | None = None) -> Entry | None:
        """The entry of ``job_id`` with these bytes that ``owner`` stored (of ``rank`` when given)."""
        with self._lock:
            if rank is not None:
                return self._entries.get((owner, job_id, rank, sha256))
            for (o, j, _, s), entry in self._entries.items():
                if o == owner and j == job_id and s == sha256:
                    return entry
        return None

    def jobs(self) -> set[str]:
        """The jobs with entries here."""
        with self._lock:
            return {key[1] for key in self._entries}

    def drop_job(self, job_id: str) -> int:
        """Forget every entry of ``job_id`` (whoever stored it); how many went."""
        with self._lock:
            keys = [key for key in self._entries if key[1] == job_id]
            for key in keys:
                self._pop(key)
        return len(keys)

    def replace_data(self, owner: str, job_id: str, rank: int, sha256: str, data: bytes | bytearray) -> None:
        """Overwrite an entry's bytes, keeping its sha256 (tests: memory that went bad)."""
        with self._lock:
            key = (owner, job_id, rank, sha256)
            old = self._entries[key]
            self._used += len(data) - len(old.data)
            self._entries[key] = Entry(old.owner, job_id, rank, sha256, data, old.stored_at)
