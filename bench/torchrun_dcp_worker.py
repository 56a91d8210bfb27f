"""The baseline of bench/recovery.py: tiny_gpt as a user would run it without Trainyard.

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 bench/torchrun_dcp_worker.py \
        --ckpt-dir DIR --timeline FILE --steps 120 --interval 20 --crash-at-step 50

The same model, data, optimizer and schedule as ``worker_runtime.examples.tiny_gpt`` (its Trainer),
checkpointed with ``torch.distributed.checkpoint`` (DCP) to local disk every ``--interval`` steps
and resumed from the newest complete checkpoint when torchrun restarts the worker group. Rank
``--crash-rank`` SIGKILLs itself at ``--crash-at-step`` in the first worker group only. Rank 0
(and the crashing rank) append timestamped JSON lines to ``--timeline``: start (with the process's
creation time), restored, first_step, save, crash, done.
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.time()  # before the heavy imports: what a restart costs includes them
# ruff: noqa: E402

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from worker_runtime import WorkerContext, init_distributed, shutdown_distributed, weights_sha256
from worker_runtime.examples.tiny_gpt import Config, Trainer
from worker_runtime.state import capture_rng_state, restore_rng_state


class Timeline:
    def __init__(self, path: Path, rank: int) -> None:
        self.path, self.rank = path, rank
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def write(self, event: str, *, force: bool = False, **data: Any) -> None:
        if self.rank != 0 and not force:
            return
        line = {"event": event, "t": time.time(), "rank": self.rank, "restart": self.restart, **data}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")


def _state(trainer: Trainer, rank: int) -> dict[str, Any]:
    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    # Per-rank state under per-rank keys: DCP keeps one copy of a key that every rank saves.
    return {"model": model, "optim": optim, "scheduler": trainer.scheduler.state_dict(),
            "step": trainer.step.state_dict(), f"data_{rank}": trainer.position.state_dict(),
            f"rng_{rank}": capture_rng_state()}


def _latest(ckpt_dir: Path) -> Path | None:
    done = sorted(p for p in ckpt_dir.glob("step-*") if (p / ".metadata").exists())
    return done[-1] if done else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--timeline", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--step-delay-s", type=float, default=0.0)
    parser.add_argument("--crash-at-step", type=int, default=0)
    parser.add_argument("--crash-rank", type=int, default=1)
    args = parser.parse_args()

    ctx = WorkerContext.from_env()
    torch.use_deterministic_algorithms(True)
    cfg = Config(steps=args.steps, step_delay_s=args.step_delay_s)
    timeline = Timeline(args.timeline, ctx.rank)
    timeline.write("start", process_started=PROCESS_STARTED)
    init_distributed(ctx, timeout=300)
    timeline.write("initialised")
    try:
        trainer = Trainer(cfg, ctx)
        latest = _latest(args.ckpt_dir)
        if latest is not None:
            state = _state(trainer, ctx.rank)
            dcp.load(state, checkpoint_id=str(latest))
            set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            trainer.scheduler.load_state_dict(state["scheduler"])
            trainer.step.load_state_dict(state["step"])
            trainer.position.load_state_dict(state[f"data_{ctx.rank}"])
            restore_rng_state(state[f"rng_{ctx.rank}"])
            timeline.write("restored", step=trainer.step.value)
        first = trainer.step.value + 1
        while trainer.step.value < cfg.steps:
            loss = trainer.train_step()
            step = trainer.step.value
            if step == args.crash_at_step and ctx.rank == args.crash_rank and timeline.restart == 0:
                timeline.write("crash", force=True, step=step)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.interval == 0:
                started = time.monotonic()
                path = args.ckpt_dir / f"step-{step:09d}"
                dcp.save(_state(trainer, ctx.rank), checkpoint_id=str(path))
                pause = time.monotonic() - started
                size = sum(f.stat().st_size for f in path.iterdir())
                timeline.write("save", step=step, pause_s=pause, bytes=size)
            if args.step_delay_s:
                time.sleep(args.step_delay_s)
            if step == first:
                trainer.global_mean(loss)  # every rank has taken the step
                timeline.write("first_step", step=step)
        dist.barrier()
        timeline.write("done", step=trainer.step.value, weights_sha256=weights_sha256(trainer.model))
    finally:
        shutdown_distributed()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
