"""What a checkpoint costs the training loop, synchronous against asynchronous, and how fast it uploads.

For a state of about 50 MB, 500 MB and 2 GB per rank (one rank, float32 tensors), in one run:
- the floor: a plain in-memory copy of the same state (``tensor.clone()``);
- a synchronous save (``async_upload=False``): serialise, hash, upload and report before going on;
- an asynchronous save: the loop waits only for a copy in host memory (worker_runtime/checkpoint/
  snapshot.py); serialising, hashing, the upload and the report run in the background;
- the upload itself (the save's storage put, same client) against a raw put of the same bytes.
Targets (issue 12): async blocking within 2x of the copy floor; upload at least 80% of the raw put.
Starts an embedded S3 (SeaweedFS ``weed mini``). Medians of ``--repeat`` runs.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/checkpoint.py [--sizes-mb 50,500,2000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainyard.embedded import EmbeddedS3  # noqa: E402
from trainyard.storage.s3 import S3Config, S3Storage  # noqa: E402
from worker_runtime import CheckpointManager, TrainState, WorkerContext  # noqa: E402


class Blob:
    """A model's worth of float32 parameters in a few tensors (state_dict / load_state_dict)."""

    def __init__(self, megabytes: int) -> None:
        n = megabytes * 2**20 // 4
        self.tensors = {f"w{i}": torch.randn(n // 4) for i in range(4)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensors = state


class Quiet:
    """Takes the shard reports (no agent in this bench)."""

    stale = False

    def shard(self, **_: object) -> bool:
        return True

    def event(self, *_: object, **__: object) -> bool:
        return True


def ctx() -> WorkerContext:
    return WorkerContext(job_id="bench", attempt_id="a", attempt_number=1, rank=0, local_rank=0, world_size=1,
                         local_world_size=1, node_rank=0, fencing_token="t", agent_url=None, device="cpu",
                         checkpoint={"interval_steps": 1})


def measure(storage: S3Storage, mb: int, repeat: int) -> dict[str, float]:
    blob = Blob(mb)
    state = TrainState()
    state.register("model", blob)
    copy_s, sync_s, async_s, put_s, raw_s, size = [], [], [], [], [], 0
    for i in range(repeat):
        t = time.perf_counter()
        copies = {k: v.clone() for k, v in blob.tensors.items()}
        copy_s.append(time.perf_counter() - t)
        del copies
        with CheckpointManager(ctx(), state, storage=storage, reporter=Quiet(), async_upload=False) as sync:
            t = time.perf_counter()
            sync.save(2 * i + 1)
            sync_s.append(time.perf_counter() - t)
        with CheckpointManager(ctx(), state, storage=storage, reporter=Quiet()) as asynchronous:
            t = time.perf_counter()
            asynchronous.save(2 * i + 2)
            async_s.append(time.perf_counter() - t)
            asynchronous.wait()
            record = asynchronous.saves[-1]
            assert record.ok, record.error
            put_s.append(record.put_s)
            size = record.size_bytes
        payload = io.BytesIO()
        torch.save(state.shard_state_dict(0), payload)
        data = payload.getvalue()
        t = time.perf_counter()
        storage.put_object(f"bench/raw-{mb}-{i}", io.BytesIO(data), length=len(data))
        raw_s.append(time.perf_counter() - t)
    med = statistics.median
    return {"mb": mb, "bytes": size, "copy": med(copy_s), "sync": med(sync_s), "async": med(async_s),
            "put": med(put_s), "raw": med(raw_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="50,500,2000")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mb.split(",")]
    with tempfile.TemporaryDirectory(prefix="trainyard-ckpt-bench-") as tmp:
        server = EmbeddedS3(Path(tmp) / "s3", access_key="bench", secret_key=secrets.token_urlsafe(16),
                            bucket="trainyard", volume_size_limit_mb=1024)
        try:
            storage = S3Storage(S3Config(endpoint=server.endpoint, bucket="trainyard", access_key="bench",
                                         secret_key=server.secret_key, secure=False), timeout_s=600, retries=0)
            storage.ensure_bucket()
            rows = [measure(storage, mb, args.repeat) for mb in sizes]
        finally:
            server.stop()
    print("| state per rank | copy (floor) | sync save blocks | async save blocks | async / floor | "
          "upload MB/s | raw put MB/s | upload / raw |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mbps, raw = r["bytes"] / r["put"] / 1e6, r["bytes"] / r["raw"] / 1e6
        print(f"| {r['bytes'] / 1e6:,.0f} MB | {r['copy']:.3f} s | {r['sync']:.3f} s | {r['async']:.3f} s | "
              f"{r['async'] / r['copy']:.2f} | {mbps:,.0f} | {raw:,.0f} | {mbps / raw:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
