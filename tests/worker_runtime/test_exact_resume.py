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
case (one for spawned workers: each imports torch). The cases run in-process with one rank. Under
torchrun: the dropout job with DDP on 2 ranks, and ``train_layout`` (the same kind of job, with a
LayerNorm, under the layout the job asks for: FSDP2, DDP and HSDP with accumulation) on 2 and 4
ranks. torch.compile is bench/exact_resume.py's case: a cold inductor compile costs tens of seconds.
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
from worker_runtime import TrainLoop, WorkerContext, apply_layout, weights_sha256

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


class Blocks(nn.Module):
    """The dropout MLP as a user writes it for sharding: blocks in a ModuleList (what apply_layout's
    FSDP2 shards one by one, then the root), a LayerNorm, dropout after each block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([
            nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.2)),
            nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.2)),
        ])
        self.head = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train_layout(ctx: WorkerContext) -> dict[str, Any]:
    """The user's script under the job's layout (``ctx.layout``), applied the documented way
    (docs/planner.md: ``apply_layout``; TrainLoop's own ``ddp`` is plain DDP only). Every rank
    returns its own losses; the weights' sha256 is over the gathered full parameters."""
    torch.manual_seed(1000 + ctx.attempt_number)
    random.seed(2000 + ctx.attempt_number)
    np.random.seed(3000 + ctx.attempt_number)
    losses: dict[int, float] = {}
    with TrainLoop(total_steps=STEPS, seed=5, log_every=5, ctx=ctx) as loop:
        torch.manual_seed(0)
        model = loop.register("model", Blocks())
        parallel = apply_layout(model, loop.ctx)  # DDP, FSDP2 or HSDP: before the optimizer
        for name, extra in parallel.extra_state.items():
            loop.register(name, extra, per_rank=True)
        optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        schedule = loop.register("schedule", torch.optim.lr_scheduler.StepLR(optimizer, 4, 0.5))
        # A global batch of 8 whatever the ranks: an epoch (48 samples) is 6 steps.
        data = loop.data_loader(Points(), batch_size=8 // ctx.world_size)
        parallel.settle(torch.zeros(1, 8))  # DDP's buckets (FSDP2: nothing)
        accum = parallel.accum_steps
        for step, (x, y) in loop.steps(data):
            micro = (step - 1) % accum  # the checkpoints of steps 3 and 9 cut a window of 2
            with parallel.micro_step(micro):
                loss = F.cross_entropy(parallel.module(x), y)
                (loss / accum).backward()
            if micro == accum - 1:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                schedule.step()
            losses[step] = loss.item()
            loop.log(loss=loss)
        result = {"losses": losses, "sha": weights_sha256(model), "restored": loop.restored_step}
        del parallel  # a DDP wrapper before the process group
        return result


LAYOUT_LAUNCHES: dict[str, tuple[int, int, dict[str, dict[str, Any]]]] = {
    # ranks, "nodes" of consecutive ranks (hsdp's default shard group: one node's ranks), and the
    # cases run one after the other in that launch: torchrun's start costs seconds, each attempt
    # one or two (rank 0 looks for unregistered state at its first step and first save). Step 3 is
    # mid epoch (and mid window with accumulation), step 6 an epoch boundary; each kind of point is
    # resumed under FSDP2 by hsdp-accum, and an epoch boundary under DDP by
    # test_two_ranks_under_torchrun_resume_the_dropout_job_exactly, so the 2-rank cases resume
    # from step 3 only.
    "2-ranks": (2, 1, {
        "fsdp": {"layout": {"kind": "fsdp"}, "resume_from": [3]},
        "ddp-accum": {"layout": {"kind": "ddp", "grad_accum_steps": 2}, "resume_from": [3]},  # DDP's no_sync grads
    }),
    "4-ranks-2-nodes": (4, 2, {
        "hsdp-accum": {"layout": {"kind": "hsdp", "grad_accum_steps": 2}, "resume_from": [3, 6]},
    }),
}


@pytest.mark.parametrize("launch", list(LAYOUT_LAUNCHES))
def test_a_resumed_user_job_matches_the_unbroken_run_under_each_layout(
        launch: str, process_reaper: ProcessReaper, s3_bucket: S3Bucket) -> None:
    """``train_layout`` under each layout the runtime applies, multi-rank under torchrun: FSDP2 on 2
    ranks, DDP with accumulation on 2, HSDP (2 replicas x a shard group of 2, one per "node") with
    accumulation on 4; tp_dp is planned only (apply_layout refuses it: test_layouts.py). For each,
    the reference, then the resumes of its ``resume_from`` in the same launch
    (layout_resume_worker.py). Every rank's loss at every step after the resume point and the
    gathered weights must be bit-identical, and nothing is reported as escaping the checkpoint."""
    ranks, nodes, cases = LAYOUT_LAUNCHES[launch]
    with serve_fake_agent() as agent:
        env = {"TRAINYARD_AGENT_URL": agent.url, "TRAINYARD_DEVICE": "cpu", "TRAINYARD_JOB_ID": "job-layout",
               "TRAINYARD_ATTEMPT_ID": "att-0", "TRAINYARD_FENCING_TOKEN": "tok-0",
               "TRAINYARD_CHECKPOINT": json.dumps({"interval_steps": 3}),
               "TRAINYARD_S3_ENDPOINT": s3_bucket.endpoint, "TRAINYARD_S3_ACCESS_KEY": s3_bucket.access_key,
               "TRAINYARD_S3_SECRET_KEY": s3_bucket.secret_key, "TRAINYARD_S3_BUCKET": s3_bucket.bucket,
               "TRAINYARD_S3_SECURE": "0", "LAYOUT_TEST_NODES": str(nodes), "LAYOUT_TEST_CASES": json.dumps(cases)}
        out, stdout = run_torchrun(process_reaper, ["tests.worker_runtime.layout_resume_worker"], env, nproc=ranks)
        shards, inexact = agent.shards(), agent.events("resume.inexact")
    assert sorted(out) == sorted(cases), stdout
    for name, ran in out.items():
        resume_from = cases[name]["resume_from"]
        # The plans the worker built from S3 are what the control plane would commit from the reports.
        mine = [s for s in shards if s["fencing_token"] == f"tok-{name}-0"]
        for plan, step in zip(ran["plans"], resume_from, strict=True):
            expected = manifest_from_shards(mine, job_id=f"job-layout-{name}", attempt_id="att-0",
                                            attempt_number=0, step=step, world_size=ranks, num_nodes=nodes)
            assert plan["candidates"][0]["shards"] == expected["shards"], name
        for rank, (reference, *resumed) in enumerate(ran["ranks"]):
            assert reference["restored"] is None and sorted(map(int, reference["losses"])) == list(range(1, STEPS + 1))
            for result, step in zip(resumed, resume_from, strict=True):
                where = f"{name}, rank {rank}, resumed from step {step}"
                assert result["restored"] == step, where
                assert result["losses"] == {s: v for s, v in reference["losses"].items() if int(s) > step}, where
                assert result["sha"] == reference["sha"], where
    assert inexact == [], inexact


if __name__ == "__main__":  # a rank under torchrun (the test above)
    train(CASES["dropout-sgd-steplr"], WorkerContext.from_env())
