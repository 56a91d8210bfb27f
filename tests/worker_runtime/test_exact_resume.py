"""Exact resume for training code written as a user would from docs/writing-jobs.md (issue 24).

Each case is a small job of its own (own model, own Dataset through ``loop.data_loader``): one
run saves a checkpoint every 3 steps (real S3, the agent's local API played by the fake agent) and
is the reference; then a new attempt restores each chosen checkpoint and runs to the end, in a
process whose global streams (torch, Python, NumPy) were moved elsewhere, as a fresh process's
are. The weights AND every step's loss after the resume point must be bit-identical.

A kill's point decides only which checkpoint the next attempt restores: killed mid-epoch, at an
epoch boundary or just after a commit, it restores the checkpoint just taken; killed between a
save's start and its commit, the one before. So resuming from each of the checkpoints at steps 3
(mid epoch, mid accumulation window) and 6 (an epoch boundary: 48 samples, 8 a step) covers each
kind of kill point (the checkpoints of steps 9 and 12 are two more of the same kinds): two resumes a
case (one for spawned workers: each imports torch). The cases run in-process with one rank; the
multi-rank layouts (DDP, HSDP, PowerSGD) are test_tiny_gpt.py's four-rank torchrun test.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from tests.conftest import S3Bucket
from tests.helpers import ProcessReaper
from tests.worker_runtime.fake_agent import FakeAgent, manifest_from_shards, serve_fake_agent
from tests.worker_runtime.torchrun import run_torchrun
from worker_runtime import TrainLoop, WorkerContext, weights_sha256

JOB = "job-exact"
PREFIX = f"jobs/{JOB}/checkpoints"
STEPS = 14
RESUME_FROM = (3, 6)


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """48 samples of a noisy 2-class problem, fixed by the seed (the same on every attempt)."""

    def __init__(self, augment: bool = False) -> None:
        generator = torch.Generator().manual_seed(11)
        self.x = torch.randn(48, 8, generator=generator)
        self.y = (self.x[:, 0] + self.x[:, 1] > 0).long()
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if self.augment:  # drawn wherever the sample is loaded: a DataLoader worker or the trainer
            if torch.rand(()) < 0.5:
                x = x.flip(0)
            x = x + 0.1 * torch.randn_like(x) + float(np.random.uniform(-0.05, 0.05)) + random.gauss(0, 0.01)
        return x, self.y[index]


class Images(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """48 tiny 1x6x6 images with random flips and noise (for the conv net with BatchNorm)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(12)
        self.x = torch.randn(48, 1, 6, 6, generator=generator)
        self.y = (self.x.mean(dim=(1, 2, 3)) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[index]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x + 0.05 * torch.randn_like(x), self.y[index]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An endless stream the user positions through its own registered state (no map-style index):
    sample ``n`` is drawn from ``(seed, n)``, and the state is how many were read."""

    def __init__(self) -> None:
        self.read = 0

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            x = torch.randn(8, generator=torch.Generator().manual_seed(self.read))
            self.read += 1
            yield x, (x[0] + x[1] > 0).long()

    def state_dict(self) -> dict[str, Any]:
        return {"read": self.read}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.read = int(state_dict["read"])


def mlp(dropout: float) -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 2))


def convnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.1),
                         nn.Linear(4 * 4 * 4, 2))


@dataclass(frozen=True)
class Case:
    model: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] = lambda m: torch.optim.SGD(
        m.parameters(), lr=0.05, momentum=0.9)
    schedule: Callable[[torch.optim.Optimizer], Any] | None = lambda o: torch.optim.lr_scheduler.StepLR(o, 4, 0.5)
    dataset: Callable[[], Dataset[Any]] = Points
    loader: dict[str, Any] | None = None
    accumulate: int = 1
    """Optimizer steps every this many loop steps (a window the checkpoint at step 3 or 9 cuts)."""
    in_step_draws: bool = False
    """Python random and NumPy draws in the step (scaling the loss)."""
    ema: bool = False
    """A registered EMA copy of the weights, updated after each optimizer step."""
    resume_from: tuple[int, ...] = RESUME_FROM
    stream: bool = False
    """The data is a registered Stream through a DataLoader of the user's own."""


CASES: dict[str, Case] = {
    # The first user job: own Dataset, nn.Dropout, SGD with momentum, StepLR.
    "dropout-sgd-steplr": Case(lambda: mlp(0.2)),
    "batchnorm-adamw": Case(convnet, dataset=Images,
                            optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)),
    "workers-fork": Case(lambda: mlp(0.2), dataset=lambda: Points(augment=True),
                         loader={"num_workers": 2, "multiprocessing_context": "fork"}),
    "workers-spawn-persistent": Case(lambda: mlp(0.2), dataset=lambda: Points(augment=True),
                                     loader={"num_workers": 2, "multiprocessing_context": "spawn",
                                             "persistent_workers": True},
                                     resume_from=(3,)),  # each spawned worker imports torch: seconds
    "augment-in-process": Case(lambda: mlp(0.0), dataset=lambda: Points(augment=True)),
    "lambdalr-warmup-random-numpy": Case(
        lambda: mlp(0.2), in_step_draws=True,
        schedule=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 5))),
    "onecycle-adamw-ema": Case(
        lambda: mlp(0.2), ema=True, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
        schedule=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=STEPS)),
    "bf16-autocast-cpu": Case(lambda: mlp(0.2), loader={"autocast": True}),
    # The optimizer steps every 2 loop steps: the checkpoint of step 3 holds half a window's gradients.
    "accumulate-mid-window": Case(lambda: mlp(0.2), accumulate=2),
    "registered-stream": Case(lambda: mlp(0.2), stream=True),
}


def _ctx(bucket: S3Bucket, agent: FakeAgent, attempt: int, restore_from: Any = None) -> WorkerContext:
    storage = {"endpoint": bucket.endpoint, "access_key": bucket.access_key, "secret_key": bucket.secret_key,
               "bucket": bucket.bucket, "secure": "0"}
    return WorkerContext(job_id=JOB, attempt_id=f"att-{attempt}", attempt_number=attempt,
                         fencing_token=f"tok-{attempt}", agent_url=agent.url, device="cpu",
                         checkpoint={"interval_steps": 3}, restore_from=restore_from, storage=storage,
                         checkpoint_prefix=PREFIX)


def train(case: Case, ctx: WorkerContext) -> dict[str, Any]:
    """The user's script; returns each step's loss and the final weights' (and EMA's) sha256."""
    # A new process starts with other global streams: the restore must put back the saved ones.
    torch.manual_seed(1000 + ctx.attempt_number)
    random.seed(2000 + ctx.attempt_number)
    np.random.seed(3000 + ctx.attempt_number)
    options = dict(case.loader or {})
    autocast = options.pop("autocast", False)
    losses: dict[int, float] = {}
    with TrainLoop(total_steps=STEPS, seed=5, log_every=5, ctx=ctx) as loop:
        torch.manual_seed(0)  # the same initial weights on every attempt
        model = loop.register("model", case.model())
        optimizer = loop.register("optimizer", case.optimizer(model))
        schedule = loop.register("schedule", case.schedule(optimizer)) if case.schedule else None
        ema = loop.register("ema", torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))) if case.ema else None
        if case.stream:  # the user's own loader over a stream whose position they registered
            data: Any = DataLoader(loop.register("stream", Stream(), per_rank=True), batch_size=8)
        else:
            data = loop.data_loader(case.dataset(), batch_size=8, **options)
        net = loop.ddp(model)  # DDP when torchrun starts several ranks (test_two_ranks...)
        for step, (x, y) in loop.steps(data):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(net(x), y)
            if case.in_step_draws:
                loss = loss * (1 + random.random() * 0.1) * float(1 + np.random.rand() * 0.1)
            (loss / case.accumulate).backward()
            if step % case.accumulate == 0:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if schedule is not None:
                    schedule.step()
                if ema is not None:
                    ema.update_parameters(model)
            losses[step] = loss.item()
            loop.log(loss=loss)
        result = {"losses": losses, "sha": weights_sha256(model), "restored": loop.restored_step,
                  "ema": weights_sha256(ema) if ema is not None else None}
        loop.result(result)  # rank 0 prints it as its JSON line (the torchrun test reads it)
        del net  # DDP before the process group
        return result


def _check_resumes(case: Case, bucket: S3Bucket, agent: FakeAgent) -> None:
    reference = train(case, _ctx(bucket, agent, 0))
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    shards = agent.shards()
    assert sorted({s["step"] for s in shards}) == [3, 6, 9, 12]
    for attempt, step in enumerate(case.resume_from, start=1):
        plan = {"candidates": [manifest_from_shards(shards, job_id=JOB, attempt_id="att-0", attempt_number=0,
                                                    step=step, world_size=1)]}
        resumed = train(case, _ctx(bucket, agent, attempt, plan))
        assert resumed["restored"] == step
        after = {s: loss for s, loss in reference["losses"].items() if s > step}
        assert resumed["losses"] == after, f"resumed from step {step}"
        assert (resumed["sha"], resumed["ema"]) == (reference["sha"], reference["ema"]), f"resumed from step {step}"
    # Nothing in these jobs escapes the checkpoint: no warning at the first save.
    assert agent.events("resume.inexact") == []


@pytest.mark.parametrize("name", list(CASES))
def test_a_resumed_user_job_matches_the_unbroken_run(name: str, s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    _check_resumes(CASES[name], s3_bucket, fake_agent)


class Jittered(Points):
    """A dataset that draws from a generator of its own: the runtime sees it, but cannot restore it."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = torch.Generator().manual_seed(1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().__getitem__(index)
        return x + 0.01 * torch.randn(x.shape, generator=self.rng), y


def test_what_a_checkpoint_misses_is_named_at_the_first_save(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    ctx = _ctx(s3_bucket, fake_agent, 0)
    with TrainLoop(total_steps=7, seed=5, ctx=ctx) as loop:
        torch.manual_seed(0)
        model = loop.register("model", mlp(0.0))
        optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 2)  # not registered
        ema = torch.optim.swa_utils.AveragedModel(model)  # not registered
        for _, (x, y) in loop.steps(loop.data_loader(Jittered(), batch_size=8)):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            schedule.step()
            ema.update_parameters(model)
    events = fake_agent.events("resume.inexact")
    causes = {e["data"]["cause"]: e for e in events}
    assert set(causes) == {"unregistered_scheduler", "unregistered_module", "unregistered_generator"}, events
    assert len(events) == 3  # at the first save only (steps 3 and 6 were saved)
    assert "StepLR" in causes["unregistered_scheduler"]["message"]
    assert "AveragedModel" in causes["unregistered_module"]["message"]
    assert "torch.Generator held as 'rng'" in causes["unregistered_generator"]["message"]
    assert all(e["rank"] == 0 and e["fencing_token"] == "tok-0" for e in events)


def test_two_ranks_under_torchrun_resume_the_dropout_job_exactly(process_reaper: ProcessReaper,
                                                                  s3_bucket: S3Bucket) -> None:
    """The issue's setting: the dropout job on 2 ranks (DDP, gloo), the second attempt restored from
    the checkpoint of step 6 (an epoch boundary) by a new torchrun."""
    job = "job-two-ranks"
    with serve_fake_agent() as agent:
        env = {"TRAINYARD_AGENT_URL": agent.url, "TRAINYARD_DEVICE": "cpu", "TRAINYARD_JOB_ID": job,
               "TRAINYARD_CHECKPOINT": json.dumps({"interval_steps": 3}),
               "TRAINYARD_S3_ENDPOINT": s3_bucket.endpoint, "TRAINYARD_S3_ACCESS_KEY": s3_bucket.access_key,
               "TRAINYARD_S3_SECRET_KEY": s3_bucket.secret_key, "TRAINYARD_S3_BUCKET": s3_bucket.bucket,
               "TRAINYARD_S3_SECURE": "0", "TRAINYARD_CHECKPOINT_PREFIX": f"jobs/{job}/checkpoints"}
        attempt0 = {"TRAINYARD_ATTEMPT_ID": "att-0", "TRAINYARD_ATTEMPT_NUMBER": "0", "TRAINYARD_FENCING_TOKEN": "t0"}
        first, _ = run_torchrun(process_reaper, [__name__], {**env, **attempt0})
        plan = {"candidates": [manifest_from_shards(agent.shards(), job_id=job, attempt_id="att-0", attempt_number=0,
                                                    step=6, world_size=2)]}
        attempt1 = {"TRAINYARD_ATTEMPT_ID": "att-1", "TRAINYARD_ATTEMPT_NUMBER": "1", "TRAINYARD_FENCING_TOKEN": "t1",
                    "TRAINYARD_RESTORE_FROM": json.dumps(plan)}
        resumed, stdout = run_torchrun(process_reaper, [__name__], {**env, **attempt1})
    assert first["restored"] is None and resumed["restored"] == 6, stdout
    # 48 samples over 2 ranks, 8 each a step: an epoch is 3 steps, so 14 steps cross 4 epoch boundaries.
    assert resumed["losses"] == {s: v for s, v in first["losses"].items() if int(s) > 6}
    assert resumed["sha"] == first["sha"]


if __name__ == "__main__":  # a rank under torchrun (the test above)
    train(CASES["dropout-sgd-steplr"], WorkerContext.from_env())
