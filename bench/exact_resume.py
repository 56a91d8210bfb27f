"""Exact resume on one device, case by case: a table of whether a resumed run ends with the weights,
and takes the per-step losses, of the unbroken one (issue 24).

    python -m bench.exact_resume --device cuda       # on a GPU machine (deterministic algorithms on)
    python -m bench.exact_resume --device cpu        # the same cases on CPU (tests/test_bench_exact_resume.py)

Each case is a small job written as a user would (its own model and Dataset through
``loop.data_loader``). The unbroken run keeps what a checkpoint would hold (``TrainState.state_dict``
serialised with torch.save, as CheckpointManager does) after each step in ``--resume-from``; a
resumed run, with its global streams moved elsewhere as a fresh process's are, loads it and runs to
the end. No storage is involved: the S3 path of the same cases is tests/worker_runtime/test_exact_resume.py.
On CUDA the run sets ``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG``
(before CUDA starts), adds bf16 autocast and a GradScaler case, and names the device in the table.

The ``torch.compile`` case (inductor: on CPU it builds C++ kernels with the machine's compiler)
forgets dynamo's compiled code before every run (``torch._dynamo.reset``), so a resumed run
compiles again at its first step, after the restore, as a new process does; inductor's cache on
disk stays, as it does on a node. Its first step's seconds (the compile) are printed under the
table. It is here rather than in the test suite: a cold compile took 44 s on the development
machine (under load), about 4 s with inductor's cache warm.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch starts CUDA

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from worker_runtime import TrainLoop, WorkerContext, weights_sha256  # noqa: E402


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """64 samples of a noisy 2-class problem, with optional random flips and noise."""

    def __init__(self, augment: bool) -> None:
        generator = torch.Generator().manual_seed(11)
        self.x = torch.randn(64, 16, generator=generator)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if self.augment:
            if torch.rand(()) < 0.5:
                x = x.flip(0)
            x = x + 0.1 * torch.randn_like(x) + float(np.random.uniform(-0.05, 0.05))
        return x, self.y[index]


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 2))


@dataclass(frozen=True)
class Case:
    name: str
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    augment: bool = False
    workers: int = 0
    accumulate: int = 1
    autocast: bool = False
    scaler: bool = False
    cuda_only: bool = False
    compile: bool = False
    """The forward through ``torch.compile(model)``."""


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01)


CASES = [
    Case("dropout+batchnorm, SGD momentum", sgd),
    Case("augment in 2 fork workers, AdamW", adamw, augment=True, workers=2),
    Case("accumulate 2 steps (cut mid-window)", sgd, accumulate=2),
    Case("bf16 autocast", adamw, autocast=True),
    Case("GradScaler (fp16 autocast)", sgd, scaler=True, cuda_only=True),
    Case("torch.compile (inductor), the first case's model and optimizer", sgd, compile=True),
]


class _Snapshots(TrainLoop):
    """A TrainLoop that keeps, after the chosen steps, what a checkpoint there would hold."""

    def __init__(self, keep: set[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.keep = keep
        self.saved: dict[int, bytes] = {}

    def _after(self, step: int, first: int) -> None:
        super()._after(step, first)
        if step in self.keep:
            buffer = io.BytesIO()
            torch.save(self.state.state_dict(), buffer)
            self.saved[step] = buffer.getvalue()


def train(case: Case, device: str, steps: int, *, keep: set[int] | None = None,
          restore: tuple[int, bytes] | None = None, salt: int = 0,
          first_step_s: list[float] | None = None) -> tuple[dict[int, float], str, dict[int, bytes]]:
    if case.compile:
        torch._dynamo.reset()  # compile again in this run, as a new process would
    torch.manual_seed(1000 + salt)  # a fresh process's streams: the restore must replace them
    random.seed(2000 + salt)
    np.random.seed(3000 + salt)
    ctx = WorkerContext(device="cuda" if device == "cuda" else "cpu")
    losses: dict[int, float] = {}
    snapshots = _Snapshots(keep or set(), total_steps=steps, seed=5, log_every=steps, ctx=ctx)
    with snapshots as loop:
        torch.manual_seed(0)
        model = loop.register("model", mlp().to(loop.device))
        optimizer = loop.register("optimizer", case.optimizer(model))
        scaler = loop.register("scaler", torch.amp.GradScaler("cuda")) if case.scaler else None
        options: dict[str, Any] = {}
        if case.workers:
            options = {"num_workers": case.workers, "multiprocessing_context": "fork"}
        data = loop.data_loader(Points(case.augment), batch_size=16, **options)
        if restore is not None:
            # What CheckpointManager.restore loads (the step counter included), before the first step.
            loop.state.load_state_dict(torch.load(io.BytesIO(restore[1]), weights_only=True))
        dtype = torch.float16 if case.scaler else torch.bfloat16
        net = torch.compile(model) if case.compile else model
        started = time.perf_counter()
        for step, (x, y) in loop.steps(data):
            with torch.autocast(loop.device.type, dtype=dtype, enabled=case.autocast or case.scaler):
                loss = F.cross_entropy(net(x.to(loop.device)), y.to(loop.device))
            (scaler.scale(loss / case.accumulate) if scaler else loss / case.accumulate).backward()
            if step % case.accumulate == 0:
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses[step] = loss.item()
            if first_step_s is not None and len(losses) == 1:
                first_step_s.append(time.perf_counter() - started)
        return losses, weights_sha256(model), snapshots.saved


def run(device: str, steps: int, resume_from: list[int], names: list[str] | None = None) -> list[dict[str, Any]]:
    if device == "cuda":
        torch.use_deterministic_algorithms(True)
    rows = []
    for case in CASES:
        if (case.cuda_only and device != "cuda") or (names and not any(n in case.name for n in names)):
            continue
        first: list[float] = []
        losses, sha, saved = train(case, device, steps, keep=set(resume_from), first_step_s=first)
        for salt, step in enumerate(resume_from, start=1):
            resumed, resumed_sha, _ = train(case, device, steps, restore=(step, saved[step]), salt=salt,
                                            first_step_s=first)
            after = {s: v for s, v in losses.items() if s > step}
            rows.append({"case": case.name, "resume_from": step, "weights": resumed_sha == sha,
                         "losses": resumed == after, "steps": steps, "first_step_s": first})
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--resume-from", type=int, nargs="+", default=[3, 4, 9])
    parser.add_argument("--case", action="append", help="Only the cases whose name contains this (repeatable).")
    args = parser.parse_args(argv)
    rows = run(args.device, args.steps, args.resume_from, args.case)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, deterministic algorithms "
          f"{torch.are_deterministic_algorithms_enabled()}, {args.steps} steps, 4 steps an epoch")
    print("| case | resumed after step | weights equal | losses equal |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['case']} | {row['resume_from']} | {row['weights']} | {row['losses']} |")
    for row in rows:
        if "compile" in row["case"]:
            seconds = ", ".join(f"{s:.1f}" for s in row["first_step_s"])
            print(f"{row['case']}: first step of each run (compiling) {seconds} s "
                  "(the unbroken run, then each resumed one)")
            break
    return rows


if __name__ == "__main__":
    main()
