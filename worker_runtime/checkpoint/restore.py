"""Fetch and verify this rank's shard of a committed checkpoint, and agree on it with every rank.

A restore must be all or nothing: ranks that resumed from different steps would train on silently
inconsistent state. So each rank verifies its own shard against the manifest (size, sha256, and
that it deserialises to exactly the registered state), then one all_reduce of a per-rank problem
code tells every rank whether all shards are good; if one is not, every rank moves on to the
same next candidate. Summing a vector with one slot per rank (rather than a single flag) costs
nothing more and lets rank 0 say which ranks failed and why.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import IO, Any, cast

import torch
import torch.distributed as dist

from trainyard.protocol.keys import MANIFEST_FORMAT
from trainyard.protocol.memtier import TIERS
from trainyard.protocol.storage import CheckpointStorage, ObjectNotFoundError
from worker_runtime.checkpoint.memtier import MemorySource

log = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024
_MAX_CUDA_ORDINAL = 256  # above any GPU count per node
_MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # when a plan does not give the manifest's size


class Problem(IntEnum):
    """Why a rank cannot use a candidate (0: it can)."""

    OK = 0
    FORMAT = 1
    WORLD_SIZE = 2
    NO_SHARD = 3
    MISSING = 4
    SIZE = 5
    SHA256 = 6
    UNREADABLE = 7
    STATE_MISMATCH = 8
    STORAGE = 9
    REPLICATED = 10
    MANIFEST = 11


_WHY: dict[int, str] = {
    Problem.FORMAT: "unknown manifest format",
    Problem.WORLD_SIZE: "world size differs from this attempt's",
    Problem.NO_SHARD: "manifest has no shard for the rank",
    Problem.MISSING: "shard object missing",
    Problem.SIZE: "shard size differs from the manifest",
    Problem.SHA256: "shard sha256 differs from the manifest",
    Problem.UNREADABLE: "shard does not deserialise",
    Problem.STATE_MISMATCH: "shard holds other state than the loop registers",
    Problem.STORAGE: "storage error while downloading",
    Problem.REPLICATED: "rank 0's shard, which holds the replicated state, is unusable",
    Problem.MANIFEST: "manifest missing, damaged or not the planned checkpoint's",
}

# Problems that are evidence against a checkpoint (storage trouble is not: it may pass).
def is_bad(codes: Iterable[int]) -> bool:
    return any(code not in (Problem.OK, Problem.STORAGE) for code in codes)



@dataclass
class Fetched:
    problem: Problem
    detail: str = ""
    state: dict[str, Any] | None = None
    tier: str = "s3"
    """What served the rank's own shard: ``local`` or ``peer`` (the in-memory tier), ``s3``, or
    ``process`` (its own in-process copy)."""


TIER_CODES = {"local": 1, "peer": 2, "s3": 3, "process": 4}
"""``process``: the rank's own copy kept for an in-process restart (worker_runtime/restart.py)."""


def candidates_of(plan: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """The candidates of a restore plan, most recent first (as the control plane ordered them).

    A candidate is a reference to a checkpoint (``checkpoint_id``, ``step``, ``manifest_key`` and
    the manifest's ``manifest_sha256`` / ``manifest_size_bytes``: the control plane's plans, whose
    size does not grow with the world size; see :func:`resolve`) or a whole manifest (``shards``)."""
    if not plan:
        return []
    if "shards" in plan:  # a bare manifest
        return [dict(plan)]
    return [dict(c) for c in plan.get("candidates") or [] if isinstance(c, Mapping)]


def resolve(storage: CheckpointStorage, candidate: Mapping[str, Any]) -> tuple[dict[str, Any] | None, Fetched]:
    """The manifest a candidate names: read from storage (a reference) and verified against the
    plan's size and sha256, or the candidate itself (a whole manifest)."""
    if "shards" in candidate:
        return dict(candidate), Fetched(Problem.OK)
    key = candidate.get("manifest_key")
    if not isinstance(key, str) or not key:
        return None, Fetched(Problem.FORMAT, f"candidate {dict(candidate)!r} names no manifest")
    size, sha = candidate.get("manifest_size_bytes"), candidate.get("manifest_sha256")
    limit = int(size) + 1 if isinstance(size, int) else _MAX_MANIFEST_BYTES
    try:
        data = _download(storage, key, limit=limit)
    except ObjectNotFoundError:
        return None, Fetched(Problem.MANIFEST, f"manifest {key} does not exist")
    except Exception as exc:  # unreachable, denied, timed out: not evidence against the checkpoint
        return None, Fetched(Problem.STORAGE, f"manifest {key}: {type(exc).__name__}: {exc}")
    if isinstance(size, int) and len(data) != size:
        return None, Fetched(Problem.MANIFEST, f"manifest {key} has {len(data)} bytes, the plan says {size}")
    if isinstance(sha, str) and hashlib.sha256(data).hexdigest() != sha:
        return None, Fetched(Problem.MANIFEST, f"manifest {key} has another sha256 than the plan says")
    try:
        manifest = json.loads(data)
    except ValueError as exc:
        return None, Fetched(Problem.MANIFEST, f"manifest {key} is not JSON: {exc}")
    if not isinstance(manifest, dict):
        return None, Fetched(Problem.MANIFEST, f"manifest {key} is not a JSON object")
    for field in ("checkpoint_id", "step", "world_size"):
        if field in candidate and manifest.get(field) != candidate[field]:
            return None, Fetched(Problem.MANIFEST, f"manifest {key} says {field}={manifest.get(field)!r}, "
                                                   f"the plan says {candidate[field]!r}")
    return manifest, Fetched(Problem.OK)


def fetch_shard(
    storage: CheckpointStorage,
    manifest: Mapping[str, Any],
    *,
    rank: int,
    world_size: int,
    names: Iterable[str],
    device: torch.device,
    per_rank: Iterable[str] = (),
    memory: MemorySource | None = None,
) -> Fetched:
    """Download and verify ``rank``'s shard; the loaded state dict if it is good.

    Replicated state is in rank 0's shard only (``CheckpointManager.save``): the names another
    rank's shard lacks come from rank 0's, verified the same way; per-rank names never do.
    With ``memory`` each shard is asked of the in-memory tier first (local, then peer), verified the
    same way; S3 serves what it cannot."""
    if manifest.get("format") != MANIFEST_FORMAT:
        return Fetched(Problem.FORMAT, f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    if not isinstance(manifest.get("step"), int):
        return Fetched(Problem.FORMAT, f"manifest step {manifest.get('step')!r} is not an integer")
    if manifest.get("world_size") != world_size:
        return Fetched(Problem.WORLD_SIZE, f"saved with world_size={manifest.get('world_size')}, "
                                           f"this attempt has {world_size}; resharding is not supported")
    own = _fetch_entry(storage, manifest, rank, device, memory)
    if own.problem or own.state is None:
        return own
    state, expected = own.state, set(names)
    missing = expected - set(state)
    if missing and rank != 0 and not missing & set(per_rank):
        zero = _fetch_entry(storage, manifest, 0, device, memory)
        if zero.problem or zero.state is None:
            # Rank 0 reports what is wrong with its shard; the others say whose shard failed them.
            # Storage trouble stays storage trouble: it must not read as a bad checkpoint.
            code = Problem.STORAGE if zero.problem == Problem.STORAGE else Problem.REPLICATED
            return Fetched(code, f"rank 0's shard (the replicated state): {zero.detail}")
        state.update({name: zero.state[name] for name in missing if name in zero.state})
    if set(state) != expected:
        source = " with rank 0's replicated state" if missing else ""
        return Fetched(Problem.STATE_MISMATCH, f"the shard of rank {rank}{source} holds {sorted(state)}, "
                                               f"the loop registers {sorted(expected)}")
    return own


def _from_memory(memory: MemorySource, rank: int, size: int, sha: str) -> tuple[bytes | bytearray, str] | None:
    """The shard from the first in-memory tier whose bytes match the manifest, with that tier."""
    for tier in TIERS:
        data = memory.get(rank, sha, tier)
        if data is None:
            continue
        if len(data) == size and hashlib.sha256(data).hexdigest() == sha:
            return data, tier
        log.warning("the %s memory tier gave rank %d's shard with other bytes than the manifest's; "
                    "trying the next tier", tier, rank)
    return None


def _fetch_entry(storage: CheckpointStorage, manifest: Mapping[str, Any], rank: int, device: torch.device,
                 memory: MemorySource | None = None) -> Fetched:
    """``rank``'s shard of ``manifest``, verified against its size and sha256, deserialised."""
    entry = next((s for s in manifest.get("shards") or [] if s.get("rank") == rank), None)
    if entry is None:
        return Fetched(Problem.NO_SHARD, f"no shard for rank {rank}")
    key, size, sha = str(entry["key"]), int(entry["size_bytes"]), str(entry["sha256"])
    found = _from_memory(memory, rank, size, sha) if memory is not None else None
    if found is not None:
        return _deserialise(found[0], key, device, found[1])
    try:
        data = _download(storage, key, limit=size + 1)
    except ObjectNotFoundError:
        return Fetched(Problem.MISSING, f"{key} does not exist")
    except Exception as exc:  # unreachable, denied, timed out: not evidence against the checkpoint
        return Fetched(Problem.STORAGE, f"{key}: {type(exc).__name__}: {exc}")
    if len(data) != size:
        return Fetched(Problem.SIZE, f"{key} has {'more than ' if len(data) > size else ''}{len(data)} bytes, "
                                     f"manifest says {size}")
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        return Fetched(Problem.SHA256, f"{key} has sha256 {got}, manifest says {sha}")
    return _deserialise(data, key, device, "s3")


def _deserialise(data: bytes | bytearray, key: str, device: torch.device, tier: str) -> Fetched:
    try:
        # Read in place: io.BytesIO would copy a bytearray, holding the shard twice.
        state = torch.load(cast(IO[bytes], _ViewReader(data)), map_location=_mapper(device), weights_only=True)
    except Exception as exc:
        return Fetched(Problem.UNREADABLE, f"{key}: {type(exc).__name__}: {exc}")
    del data
    if not isinstance(state, dict):
        return Fetched(Problem.STATE_MISMATCH, f"{key} holds a {type(state).__name__}, not a state dict")
    return Fetched(Problem.OK, state=state, tier=tier)


class _ViewReader(io.RawIOBase):
    """A seekable file over bytes already in memory, without copying them."""

    def __init__(self, data: bytes | bytearray) -> None:
        self._view = memoryview(data).cast("B")
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._pos))
        buffer[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n


def agree(problem: int, *, rank: int, world_size: int) -> list[int]:
    """Every rank's problem code (one all_reduce when distributed); all zero means all good.

    With more than one rank there must be a process group: a rank that decided alone could
    restore a checkpoint that another rank rejects, and the ranks would train on different state."""
    if world_size == 1:
        return [int(problem)]
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"rank {rank} of {world_size} cannot agree on a checkpoint without a process group: "
                           f"call init_distributed before restoring")
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    codes = torch.zeros(world_size, dtype=torch.int64, device=device)
    codes[rank] = int(problem)
    dist.all_reduce(codes)
    return [int(c) for c in codes.tolist()]


def describe(codes: list[int]) -> str:
    """A one-line reason from every rank's code, e.g. 'rank 1: shard sha256 differs ...'."""
    groups: dict[int, list[int]] = {}
    for r, code in enumerate(codes):
        if code:
            groups.setdefault(code, []).append(r)
    parts = []
    for code, ranks in sorted(groups.items()):
        if len(codes) > 1 and len(ranks) == len(codes):
            who = "all ranks"
        else:
            who = ("ranks " if len(ranks) > 1 else "rank ") + ",".join(map(str, ranks[:8]))
            who += ",..." if len(ranks) > 8 else ""
        parts.append(f"{who}: {_WHY.get(code, f'problem {code}')}")
    return "; ".join(parts)


def _download(storage: CheckpointStorage, key: str, *, limit: int) -> bytes:
    """At most ``limit`` bytes of ``key`` (a shard larger than its manifest is not read in full)."""
    stream = storage.get_object(key)
    out = io.BytesIO()
    try:
        while out.tell() < limit:
            chunk = stream.read(min(_CHUNK, limit - out.tell()))
            if not chunk:
                break
            out.write(chunk)
    finally:
        stream.close()
        release = getattr(stream, "release_conn", None)
        if release is not None:
            release()
    return out.getvalue()


def _mapper(device: torch.device) -> dict[str, str]:
    """CUDA storages go to this rank's GPU (the saving rank's ordinal may differ, or not exist
    here); CPU storages stay on the CPU (RNG states must). A dict, not a callable: torch.load
    refuses callables for tensor subclasses such as DTensor."""
    target = str(device) if device.type == "cuda" else "cpu"
    return {f"cuda:{i}": target for i in range(_MAX_CUDA_ORDINAL)} | {"cuda": target}
