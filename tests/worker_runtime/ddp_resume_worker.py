"""Run under torchrun by test_tiny_gpt: a run resumed from saved state at step k must end
bit-identical to the uninterrupted run, under each layout of DDP_RESUME_LAYOUTS (a JSON object, name
-> layout; null: plain DDP), one after the other in the same processes and process group (a torch
worker costs seconds to start). Rank 0 prints, for each, both results and what the layout applied,
as one JSON line."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import Any

import torch

from trainyard.protocol.layout import Layout
from worker_runtime import Reporter, WorkerContext, init_distributed, shutdown_distributed
from worker_runtime.examples.tiny_gpt import Config, Trainer
from worker_runtime.state import holds_dtensor

CFG = Config(steps=12, batch_size=4, seq_len=16, d_model=32, layers=1, heads=2, log_every=4)


def compare(ctx: WorkerContext) -> dict[str, Any]:
    # Its own function so every DDP module is gone before the process group is destroyed:
    # a DDP reducer outliving its gloo group can hang the process at exit.
    with Reporter(ctx, echo=False) as reporter:
        uninterrupted = Trainer(CFG, ctx).fit(reporter)
        first = Trainer(CFG, ctx)
        first.fit(reporter, until=5)
        buffer = io.BytesIO()
        torch.save(first.state.state_dict(), buffer)  # every rank keeps its own copy
        buffer.seek(0)
        torch.manual_seed(999 + ctx.rank)  # the resumed process starts with other RNG state
        resumed = Trainer(CFG, ctx)
        resumed.state.load_state_dict(torch.load(buffer, weights_only=True))
        result = resumed.fit(reporter)
    # What the layout did to the model: its parameters' local size on this rank, the state saved.
    local = sum((p.to_local() if holds_dtensor(p) else p).numel() for p in resumed.model.parameters())
    applied = {"local_numel": local, "numel": sum(p.numel() for p in resumed.model.parameters()),
               "state": resumed.state.names(), "wrapper": type(resumed.ddp).__name__}
    return {"uninterrupted": uninterrupted, "resumed": result, "applied": applied}


def main() -> None:
    ctx = WorkerContext.from_env()
    torch.use_deterministic_algorithms(True)
    init_distributed(ctx, timeout=60)
    try:
        layouts = json.loads(os.environ["DDP_RESUME_LAYOUTS"])
        results = {name: compare(dataclasses.replace(ctx, layout=Layout.model_validate(layout or {})))
                   for name, layout in layouts.items()}
        if ctx.is_main:
            print(json.dumps(results), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
