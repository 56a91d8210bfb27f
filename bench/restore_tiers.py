"""Restore of one rank's shard from each tier: the agent's memory, a peer agent's memory, and S3.

For a state of about 2 GB per rank (``--size-mb``), in one run, through the real code paths: the
worker runtime's restore (``fetch_shard``: fetch, sha256 against the manifest, ``torch.load``)
asking a real agent local API over its unix socket (node_agent/local/api.py, memtier/tier.py), which
serves its own memory (``local``) or fetches from a peer agent over TCP (``peer``); and the same
restore reading S3 (an embedded SeaweedFS, the same S3 client workers use) with the tier off.
Baselines of the same bytes in the same run: a plain in-memory copy (the floor of any restore from
memory) and a raw S3 get with the same client (the floor of a restore from S3). The fetch alone (no
verification, no load) is shown too. Medians of ``--repeat`` runs.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/restore_tiers.py [--size-mb 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.local.api import LocalApi  # noqa: E402
from node_agent.memtier.peer import serving  # noqa: E402
from node_agent.memtier.tier import AttemptMemory, MemoryTier  # noqa: E402
from trainyard.embedded import EmbeddedS3  # noqa: E402
from trainyard.protocol.keys import MANIFEST_FORMAT  # noqa: E402
from trainyard.protocol.memtier import memory_grant  # noqa: E402
from trainyard.storage.s3 import S3Config, S3Storage  # noqa: E402
from worker_runtime import WorkerContext  # noqa: E402
from worker_runtime.checkpoint.memtier import AgentMemory  # noqa: E402
from worker_runtime.checkpoint.restore import _download, fetch_shard  # noqa: E402

KEY = "bench/rank-00000.pt"


def median_s(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
        del result
    return statistics.median(times)


def shard(megabytes: int) -> bytes:
    n = megabytes * 2**20 // 4
    state = {f"w{i}": torch.randn(n // 4) for i in range(4)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def worker(api: LocalApi, attempt_id: str) -> AgentMemory:
    ctx = WorkerContext(job_id="bench", attempt_id=attempt_id, attempt_number=1, fencing_token=f"t-{attempt_id}",
                        agent_url="http://trainyard-agent", agent_socket=str(api.socket_of(attempt_id)))
    return AgentMemory(ctx)


def measure(storage: S3Storage, size_mb: int, repeat: int, sockets: Path) -> dict[str, float]:
    data = shard(size_mb)
    sha = hashlib.sha256(data).hexdigest()
    storage.put_object(KEY, io.BytesIO(data), length=len(data))
    manifest = {"format": MANIFEST_FORMAT, "step": 1, "world_size": 1,
                "shards": [{"rank": 0, "key": KEY, "size_bytes": len(data), "sha256": sha}]}
    # Room for two answers of the shard: an answer stays counted until its last bytes are sent
    # (MemoryTier.lend), a moment after which the next fetch may already ask.
    budget = 2 * len(data) + 2**20
    node_key = secrets.token_hex(32)  # the peer's grant key (an agent's: the hash of its credential)
    peer_tier = MemoryTier(budget, peer_timeout_s=600, grant_key=node_key)
    node_tier = MemoryTier(budget, peer_timeout_s=600)
    job = AttemptMemory("bench", secrets.token_hex(32))
    out: dict[str, float] = {"bytes": float(len(data))}
    with serving(peer_tier) as peer:
        peer_url = f"http://127.0.0.1:{peer.port}"
        spec = AttemptMemory(job.job_id, job.secret, peer_url, grants={peer_url: memory_grant(node_key, job.job_id)})
        api = LocalApi(memory=node_tier)
        try:
            api.reports.register("a", "t-a")
            api.open("a", sockets / "a.sock", memory=spec)
            me = worker(api, "a")
            assert me.put(0, sha, data)  # the worker's hand-over after its upload; the agent pushes the copy
            assert node_tier.wait_pushed(600) and node_tier.pushed == 1, "the push to the peer failed"

            def restore(memory: AgentMemory | None, want: str) -> object:
                got = fetch_shard(storage, manifest, rank=0, world_size=1, names=["w0", "w1", "w2", "w3"],
                                  device=torch.device("cpu"), memory=memory)
                assert got.problem == 0 and got.tier == want, (got.problem, got.detail, got.tier)
                return got.state

            out["copy"] = median_s(lambda: bytearray(data), repeat)
            out["raw_get"] = median_s(lambda: _download(storage, KEY, limit=len(data) + 1), repeat)
            out["fetch_local"] = median_s(lambda: me.get(0, sha, "local"), repeat)
            out["fetch_peer"] = median_s(lambda: me.get(0, sha, "peer"), repeat)
            out["restore_local"] = median_s(lambda: restore(me, "local"), repeat)
            node_tier.store.drop_job("bench")  # this node's memory is gone: the peer serves
            out["restore_peer"] = median_s(lambda: restore(me, "peer"), repeat)
            peer_tier.store.drop_job("bench")  # and the peer's: S3 serves
            out["restore_s3_after_misses"] = median_s(lambda: restore(me, "s3"), repeat)
            out["restore_s3"] = median_s(lambda: restore(None, "s3"), repeat)
        finally:
            api.stop()
            node_tier.stop()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trainyard-tiers-bench-") as tmp:
        server = EmbeddedS3(Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_urlsafe(16),
                            bucket="trainyard", volume_size_limit_mb=max(1024, args.size_mb * 2))
        try:
            storage = S3Storage(S3Config(endpoint=server.endpoint, bucket="trainyard", access_key="bench",
                                         secret_key=server.secret_key, secure=False), timeout_s=600, retries=0)
            storage.ensure_bucket()
            with tempfile.TemporaryDirectory(prefix="tiers-", dir="/tmp") as sockets:
                r = measure(storage, args.size_mb, args.repeat, Path(sockets))
        finally:
            server.stop()
    size = r["bytes"]
    print(f"shard: {size / 1e6:,.0f} MB; medians of {args.repeat}; ratios against the floor of the same source")
    print("| path | seconds | MB/s | vs memory copy | vs raw S3 get |")
    print("| --- | --- | --- | --- | --- |")
    rows = [
        ("plain memory copy (floor)", "copy"),
        ("raw S3 get, same client (floor)", "raw_get"),
        ("fetch from agent memory (no verify/load)", "fetch_local"),
        ("fetch from peer via agent (no verify/load)", "fetch_peer"),
        ("restore from agent memory", "restore_local"),
        ("restore from peer agent", "restore_peer"),
        ("restore from S3 (tier off)", "restore_s3"),
        ("restore from S3 after both memory tiers missed", "restore_s3_after_misses"),
    ]
    for label, key in rows:
        s = r[key]
        print(f"| {label} | {s:.3f} | {size / s / 1e6:,.0f} | {s / r['copy']:.1f}x | {s / r['raw_get']:.2f}x |")
    print(f"restore from S3 / from agent memory: {r['restore_s3'] / r['restore_local']:.1f}x; "
          f"from S3 / from peer: {r['restore_s3'] / r['restore_peer']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
