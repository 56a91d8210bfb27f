"""A tiny decoder-only transformer trained with DDP on a synthetic corpus: the reference job.

    python -m worker_runtime.examples.tiny_gpt --steps 300
    torchrun --nproc-per-node 4 -m worker_runtime.examples.tiny_gpt --steps 300

It exists to exercise the platform (gang launch, progress, results, and later checkpoints and
recovery), so it is built around one property: the run is a pure function of (arguments, world
size). The corpus is a random Markov chain drawn from ``--seed`` (no downloads, and the loss
really falls towards the chain's entropy); the batch of step ``s`` on rank ``r`` depends only on
(seed, s, r); there is no dropout; every piece of mutable state is registered in a TrainState.
So the same world size and steps give the same weights_sha256, and a run resumed from a state
saved at step k ends bit-identical to one that never stopped.

Checkpoints: with the job's ``interval_steps`` and storage set (TRAINYARD_CHECKPOINT,
TRAINYARD_STORAGE_ACCESS), every rank saves its shard after the optimizer step of every interval step, and a
new attempt first restores the newest good checkpoint of its restore plan (TRAINYARD_RESTORE_FROM)
and goes on from the step after it.

In-process restart (``--restartable``, for a job with ``restartable: true``): each attempt runs
through worker_runtime.restartable, so a rank whose peer failed does not exit: it aborts the
process group, takes its part of the next attempt from its agent and runs it in the same process,
restoring from its own in-memory copy of the planned checkpoint (worker_runtime/restart.py). The
result then also names the tier that served each rank's restore (``restored_tiers``). Without the
flag the script runs each attempt in a new process, exactly as before.

Rank 0 prints the result as one JSON line on stdout and reports it to the agent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from trainyard.protocol.layout import METRIC_COMM_S, METRIC_STEP_S
from worker_runtime import (
    CheckpointManager,
    DataPosition,
    Reporter,
    RngState,
    StaleAttemptError,
    StepCounter,
    TrainState,
    WorkerContext,
    device_of,
    init_distributed,
    is_distributed,
    shutdown_distributed,
    weights_sha256,
)
from worker_runtime.checkpoint.kept import KeptSave
from worker_runtime.examples.tiny_gpt_model import MarkovCorpus, TinyGPT
from worker_runtime.layouts import LayoutError, apply_layout


@dataclass(frozen=True, kw_only=True)
class Config:
    steps: int = 300
    seed: int = 0
    batch_size: int = 8
    """Sequences per rank per step; the global batch is batch_size * world_size."""
    seq_len: int = 32
    lr: float = 3e-3
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    vocab: int = 64
    log_every: int = 10
    step_delay_s: float = 0.0
    """Sleep after every step: makes a run slow enough for a test to kill it mid-way."""
    ckpt_upload_delay_s: float = 0.0
    """Sleep between a checkpoint shard's upload and its report: lets a test kill mid-checkpoint."""
    ckpt_slow_rank: int = -1
    """The only rank that sleeps ckpt_upload_delay_s (-1: every rank)."""
    crash_at_step: int = 0
    """Fault injection: at this step (if this process runs it), crash_rank exits with code 3."""
    crash_rank: int = 0
    crash_kill: bool = False
    """Crash by SIGKILL to itself (exit code -9) rather than exit code 3."""
    crash_once: bool = False
    """Crash only in the first run: Trainyard attempt 1, or torchrun's first worker group."""
    slow_rank: int = -1
    """Fault injection: this rank computes slow_busy_s longer every step (a slow GPU: a straggler)."""
    slow_busy_s: float = 0.0
    bf16: bool = False
    """Forward and backward under bf16 autocast (weights, optimizer and reductions stay fp32)."""
    restartable: bool = False
    """Restart in this process when a peer fails and the agent hands this rank the next attempt."""

    def __post_init__(self) -> None:
        if min(self.steps, self.batch_size, self.seq_len, self.d_model, self.layers, self.log_every) < 1:
            raise ValueError("steps, batch size, seq len, d_model, layers and log_every must be >= 1")
        if min(self.step_delay_s, self.ckpt_upload_delay_s, self.slow_busy_s) < 0:
            raise ValueError("delays must be >= 0")
        if self.crash_at_step < 0 or self.crash_rank < 0:
            raise ValueError("crash_at_step and crash_rank must be >= 0")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by heads {self.heads}")

    @property
    def warmup(self) -> int:
        return max(1, min(100, self.steps // 10))


def lr_factor(cfg: Config, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Batches:
    """The synthetic data stream: the batch of step s on rank r is a disjoint slice of step s's
    global batch, a function of (seed, s, r) only, so it is resumable from a DataPosition."""

    def __init__(self, cfg: Config, corpus: MarkovCorpus, position: DataPosition, rank: int) -> None:
        self._cfg = cfg
        self._corpus = corpus
        self._position = position
        self._rank = rank

    def next(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, step = self._cfg, self._position.offset
        first = (step * self._position.world_size + self._rank) * cfg.batch_size
        tokens = self._corpus.sample(range(first, first + cfg.batch_size), cfg.seq_len + 1)
        self._position.advance()
        tokens = tokens.to(device)
        return tokens[:, :-1], tokens[:, 1:]


class Trainer:
    """Owns the model and all training state; ``state`` is what a checkpoint saves."""

    def __init__(self, cfg: Config, ctx: WorkerContext) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.device = device_of(ctx)
        # Same seed on every rank: identical initial weights without relying on DDP's broadcast.
        torch.manual_seed(cfg.seed)
        self.model = TinyGPT(cfg.vocab, cfg.seq_len, cfg.d_model, cfg.layers, cfg.heads).to(self.device)
        # The job's layout (TRAINYARD_LAYOUT): DDP, FSDP2 or HSDP, accumulation, compression.
        self.parallel = apply_layout(self.model, ctx)
        self.ddp: nn.Module = self.parallel.module
        # Every step, the first after a restore too, then reduces in the same DDP bucket layout.
        self.parallel.settle(torch.zeros(1, cfg.seq_len, dtype=torch.long, device=self.device))
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
            foreach=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(cfg, s))
        self.position = DataPosition(world_size=ctx.world_size)
        self.step = StepCounter()
        self.batches = Batches(cfg, MarkovCorpus(cfg.vocab, cfg.seed), self.position, ctx.rank)
        self.state = TrainState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.optimizer)
        self.state.register("scheduler", self.scheduler)
        self.state.register("step", self.step)
        self.state.register("data", self.position, per_rank=True)
        self.state.register("rng", RngState(), per_rank=True)
        for name, extra in self.parallel.extra_state.items():
            self.state.register(name, extra, per_rank=True)

    def train_step(self, reporter: Reporter | None = None) -> torch.Tensor:
        """One optimizer step over the layout's micro-batches; the mean micro-batch loss.

        What this rank computes alone (the data, the forward pass) is its busy time: the watchdog
        compares it across ranks; the backward pass waits in the all-reduce for the slowest rank."""
        accum = self.parallel.accum_steps
        total = torch.zeros((), device=self.device)
        with self.parallel.meter.step():
            self.optimizer.zero_grad(set_to_none=True)
            for micro in range(accum):
                with self.parallel.micro_step(micro):
                    with reporter.timed() if reporter is not None else contextlib.nullcontext():
                        x, y = self.batches.next(self.device)
                        with torch.autocast(self.device.type, torch.bfloat16, enabled=self.cfg.bf16):
                            logits = self.ddp(x)
                            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
                        if self.cfg.slow_busy_s and self.ctx.rank == self.cfg.slow_rank:
                            time.sleep(self.cfg.slow_busy_s / accum)
                    (loss / accum if accum > 1 else loss).backward()
                total += loss.detach()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.scheduler.step()
        self.step.value += 1
        return total / accum if accum > 1 else total

    def _may_crash(self) -> bool:
        if not self.cfg.crash_once:
            return True
        # An in-process restart keeps torchrun's environment but takes the next attempt's number.
        first_group = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        return first_group and self.ctx.attempt_number <= 1

    def global_mean(self, loss: torch.Tensor, stop: bool = False,
                    metrics: dict[str, float] | None = None) -> tuple[float, bool, dict[str, float]]:
        """Mean loss and step metrics over ranks, and whether any rank wants to stop (one small
        collective). Every rank passes the same metric names (the layout's meter on each)."""
        names = sorted(metrics or {})
        values = [float((metrics or {})[n]) for n in names]
        packed = torch.tensor([float(loss), float(stop), *values], dtype=torch.float64, device=loss.device)
        if is_distributed():
            dist.all_reduce(packed)
            packed[0] /= self.ctx.world_size
            packed[2:] /= self.ctx.world_size
        means = {n: float(v) for n, v in zip(names, packed[2:].tolist(), strict=True)}
        return float(packed[0]), bool(packed[1] > 0), means

    def fit(
        self, reporter: Reporter, until: int | None = None, checkpoints: CheckpointManager | None = None
    ) -> dict[str, Any] | None:
        """Train up to step ``until`` (default: the configured steps); None if told to stop.

        Starts from the current step (a restored state resumes where it was saved). With
        ``checkpoints`` every rank saves after the optimizer step of each interval step.
        """
        until = self.cfg.steps if until is None else until
        started = time.monotonic()
        # None when this process did not see it (a run resumed past step 1, or at its end).
        initial_loss: float | None = None
        final_loss: float | None = None
        first = self.step.value + 1  # 1, or the step after the restored one
        while self.step.value < until:
            loss = self.train_step(reporter)
            step = self.step.value
            if step == self.cfg.crash_at_step and self.ctx.rank == self.cfg.crash_rank and self._may_crash():
                print(f"tiny_gpt: crashing at step {step} as asked (--crash-at-step)", file=sys.stderr, flush=True)
                if self.cfg.crash_kill:
                    os.kill(os.getpid(), signal.SIGKILL)
                os._exit(3)
            if checkpoints is not None and checkpoints.should_save(step):
                checkpoints.save(step)
            if self.cfg.step_delay_s:
                time.sleep(self.cfg.step_delay_s)
            # The first step of every attempt is reported at once: the control plane times
            # recoveries by it (failure -> first new step).
            if step in (first, until) or step % self.cfg.log_every == 0:
                # The stop flag rides on the loss collective: every rank stops at the same step.
                mean, stop, metrics = self.global_mean(loss, stop=reporter.stale,
                                                       metrics=self.parallel.meter.summary())
                # Stdout carries the result as strict JSON, which has no NaN: a diverged loss is null.
                finite = mean if math.isfinite(mean) else None
                if step == 1:
                    initial_loss = finite
                final_loss = finite
                lr = float(self.scheduler.get_last_lr()[0])
                reporter.progress(step, loss=mean, lr=lr, **metrics)
                if self.ctx.is_main:
                    elapsed = time.monotonic() - started
                    split = ""
                    if metrics.get(METRIC_STEP_S):  # the measured split of the steps since the last line
                        split = (f" | {metrics[METRIC_STEP_S] * 1e3:.1f} ms/step,"
                                 f" {metrics[METRIC_COMM_S] / metrics[METRIC_STEP_S]:.0%} communication")
                    print(f"step {step}/{until} loss {mean:.4f} lr {lr:.2e} {elapsed:.1f}s{split}", flush=True)
                if stop:
                    return None
        return {
            "final_loss": final_loss,
            "initial_loss": initial_loss,
            "weights_sha256": weights_sha256(self.model),
            "steps": self.step.value,
            "world_size": self.ctx.world_size,
        }


def parse_args(argv: Sequence[str] | None = None) -> Config:
    defaults = Config()
    parser = argparse.ArgumentParser(prog="tiny_gpt", description=__doc__.splitlines()[0])
    for name in ("steps", "seed", "batch_size", "seq_len", "d_model", "layers", "heads", "log_every",
                 "ckpt_slow_rank", "crash_at_step", "crash_rank", "slow_rank"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--crash-kill", action="store_true", help="crash by SIGKILL rather than exit code 3")
    parser.add_argument("--crash-once", action="store_true", help="crash only in the first attempt")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast for forward and backward")
    parser.add_argument("--restartable", action="store_true",
                        help="restart in process when a peer fails (a job with restartable: true)")
    parser.add_argument("--step-delay-s", type=float, default=defaults.step_delay_s)
    parser.add_argument("--ckpt-upload-delay-s", type=float, default=defaults.ckpt_upload_delay_s)
    parser.add_argument("--slow-busy-s", type=float, default=defaults.slow_busy_s)
    args = parser.parse_args(argv)
    return Config(**vars(args))


def train(cfg: Config, ctx: WorkerContext, reporter: Reporter,
          memory: KeptSave | None = None) -> dict[str, Any] | None:
    """Restore (if planned), train, drain the last checkpoint upload; the result, or None if stale.

    Its own function so that the trainer, its DDP module and the checkpoint manager holding its
    state are gone before the process group is destroyed (see shutdown_distributed). ``memory``:
    this process's copy of its last save, kept across in-process restarts (``--restartable``).
    """
    trainer = Trainer(cfg, ctx)
    delay = cfg.ckpt_upload_delay_s if cfg.ckpt_slow_rank in (-1, ctx.rank) else 0.0
    with CheckpointManager(ctx, trainer.state, upload_delay_s=delay, memory=memory) as checkpoints:
        restored = checkpoints.restore()
        if restored is not None and ctx.is_main:
            print(f"tiny_gpt: restored step {restored}; resuming at step {restored + 1}", flush=True)
        result = trainer.fit(reporter, checkpoints=checkpoints)
        # Leaving the block drains the upload in flight: the last checkpoint is reported before
        # the result (an attempt that succeeded keeps its final checkpoint).
    if result is not None:
        result["restored_from_step"] = restored
        if memory is not None:
            result["restored_tiers"] = checkpoints.restored_tiers
        saved = [s for s in checkpoints.saves if s.ok]
        result["checkpoints_saved"] = len(saved)
        if saved:
            # This rank's side of its saves: what a checkpoint costs the loop, and in the background.
            result["checkpoint_stats"] = {
                "bytes": saved[-1].size_bytes,
                "mean_pause_s": round(sum(s.snapshot_s + s.blocked_s for s in saved) / len(saved), 4),
                "mean_upload_s": round(sum(s.upload_s for s in saved) / len(saved), 4),
            }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    ctx = WorkerContext.from_env()
    if ctx.device == "cpu":
        torch.use_deterministic_algorithms(True)
    try:
        if cfg.restartable:
            from worker_runtime.restart import restartable  # deferred: only a restartable run needs it

            return restartable(lambda attempt_ctx, memory: run_attempt(cfg, attempt_ctx, memory), ctx=ctx)
        return run_attempt(cfg, ctx)
    finally:
        shutdown_distributed()


def run_attempt(cfg: Config, ctx: WorkerContext, memory: KeptSave | None = None) -> int:
    """One attempt of this rank: join its process group, train, report; the exit status. The group
    is left as it is on an error (main, or the in-process restart, takes it down)."""
    init_distributed(ctx, timeout=300)
    try:
        with Reporter(ctx, echo=False, total_steps=cfg.steps) as reporter:
            result = train(cfg, ctx, reporter, memory)
            if result is None:
                print("tiny_gpt: attempt is stale; stopping without a result", file=sys.stderr)
                return 1
            if ctx.is_main:
                print(json.dumps(result, sort_keys=True), flush=True)
                reporter.result(result)
    except StaleAttemptError as exc:
        print(f"tiny_gpt: {exc}", file=sys.stderr)
        return 1
    except LayoutError as exc:  # the same on every rank: all exit before any collective of training
        print(f"tiny_gpt: cannot apply the job's layout: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
