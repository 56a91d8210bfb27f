"""Run under torchrun by test_checkpoint_sharded: FSDP2 (DTensor) state through CheckpointManager
and S3. Each rank's shard must hold only its local part, and a restored run must continue
bit-identical. Rank 0 prints one JSON line: every rank's shard size and local/global numel."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from worker_runtime import (
    CheckpointManager,
    RngState,
    TrainState,
    WorkerContext,
    init_distributed,
    shutdown_distributed,
)


class RecordingSink:
    """Collects shard reports in memory (the agent is not under test here)."""

    def __init__(self) -> None:
        self.shards: list[dict[str, Any]] = []

    def shard(self, *, step: int, key: str, size_bytes: int, sha256: str, upload: dict | None = None,
              blocking_s: float | None = None, background_s: float | None = None) -> bool:
        self.shards.append({"step": step, "key": key, "size_bytes": size_bytes, "sha256": sha256,
                            "blocking_s": blocking_s})
        return True

    def event(self, kind: str, message: str, data: dict[str, Any] | None = None) -> bool:
        return True


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, TrainState]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = TrainState()
    state.register("model", model)
    state.register("optimizer", optimizer)
    state.register("rng", RngState(), per_rank=True)
    return model, optimizer, state


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 64)  # from the (saved and restored) RNG state
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def local_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.to_local().detach().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def run(ctx: WorkerContext) -> dict[str, Any]:
    model, optimizer, state = build(seed=0)
    for _ in range(2):
        step(model, optimizer)
    sink = RecordingSink()
    with CheckpointManager(ctx, state, interval_steps=2, reporter=sink, async_upload=False) as manager:
        assert manager.save(2)
    [mine] = sink.shards
    shards: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(shards, {**mine, "rank": ctx.rank})
    manifest = {"format": "trainyard.checkpoint/1", "step": 2, "world_size": ctx.world_size,
                "shards": [{k: s[k] for k in ("rank", "key", "size_bytes", "sha256")} for s in shards]}
    step(model, optimizer)
    expected = local_params(model)

    resumed_ctx = dataclasses.replace(ctx, restore_from={"candidates": [manifest]})
    model2, optimizer2, state2 = build(seed=123)
    with CheckpointManager(resumed_ctx, state2, reporter=RecordingSink()) as manager2:
        restored = manager2.restore()
    step(model2, optimizer2)
    same = all(torch.equal(a, b) for a, b in zip(expected, local_params(model2), strict=True))
    return {
        "restored": restored,
        "same": same,
        "size_bytes": mine["size_bytes"],
        "local_numel": sum(p.to_local().numel() for p in model.parameters()),  # type: ignore[attr-defined]
        "global_numel": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    ctx = WorkerContext.from_env()
    torch.use_deterministic_algorithms(True)
    init_distributed(ctx, timeout=60)
    try:
        mine = run(ctx)
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, mine)
        if ctx.is_main:
            print(json.dumps(everyone), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
