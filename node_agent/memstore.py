"""The agent's bounded store of checkpoint shards in host memory (the in-memory tier's local copy;
trainyard/protocol/memtier.py, docs/architecture.md "In-memory checkpoint tier").

Held by the agent, not the worker, so that it outlives a killed rank. An entry is the bytes of one
shard, keyed by job, rank, sha256 and the digest of the credential that stored it (its owner): a
lookup must name the owner, the job and the sha256, so one job's credential never finds another
job's bytes. Only the latest ``keep_per_rank`` entries per (owner, job, rank) are kept: two by
default, the shard just saved (which may never be committed: another rank may die before it
saves) and the one before it (which then is the committed one a restore asks for). When the budget
would be exceeded the oldest entries go first, so the older generation goes before the newer. The
store is an accelerator: nothing counts on an entry being there, and a restore always verifies what
it gets against the committed manifest.
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
            verify: bool = True) -> list[Entry]:
        """Store ``data`` as the latest shard of (job, rank) for ``owner``; returns the entries
        evicted (the rank's oldest past keep_per_rank, then the oldest of all to make room). Raises
        ShardRefused when the bytes do not hash to ``sha256`` or the shard alone is larger than the
        budget (nothing changes then)."""
        if len(data) > self.budget_bytes:
            raise ShardRefused(f"a shard of {len(data)} bytes is over this agent's memory budget of "
                               f"{self.budget_bytes} bytes")
        if verify and hashlib.sha256(data).hexdigest() != sha256:
            raise ShardRefused("the shard's bytes do not match its sha256")
        entry = Entry(owner, job_id, rank, sha256, data, time.monotonic())
        key = (owner, job_id, rank, sha256)
        evicted: list[Entry] = []
        with self._lock:
            old = self._entries.pop(key, None)  # the same bytes again: now the newest
            if old is not None:
                self._used -= len(old.data)
            mine = [k for k in self._entries if k[:3] == key[:3]]
            for k in mine[:max(0, len(mine) - self.keep_per_rank + 1)]:
                evicted.append(self._pop(k))
            while self._entries and self._used + len(data) > self.budget_bytes:
                evicted.append(self._pop(next(iter(self._entries))))
            self._entries[key] = entry
            self._used += len(data)
            self.evictions += len(evicted)
        return evicted

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
