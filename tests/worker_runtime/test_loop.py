"""TrainLoop and ResumableSampler (issue 13, writing your own job): the loop's bookkeeping makes a
resumed run exact without the script doing anything for it (real S3, the agent's local API played
by the fake agent), reports progress with the total and metrics, and the sampler's position
names the same samples only for the world size and dataset it was saved with."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from tests.conftest import S3Bucket
from tests.worker_runtime.fake_agent import FakeAgent, manifest_from_shards
from worker_runtime import ResumableSampler, TrainLoop, WorkerContext, WorldSizeMismatchError, weights_sha256

JOB = "job-loop"
PREFIX = f"jobs/{JOB}/checkpoints"
STEPS = 14


@settings(max_examples=25, deadline=None)
@given(size=st.integers(8, 200), world=st.integers(1, 4), seed=st.integers(0, 10), epoch=st.integers(0, 3),
       taken=st.integers(0, 50))
def test_sampler_order_is_a_function_of_its_state(size, world, seed, epoch, taken):
    samplers = [ResumableSampler(size, rank=r, world_size=world, seed=seed) for r in range(world)]
    orders = [s.order(epoch) for s in samplers]
    # Disjoint shares of one permutation, the same length on every rank.
    assert len({len(o) for o in orders}) == 1 and len(orders[0]) == size // world
    assert len(set().union(*orders)) == sum(len(o) for o in orders)
    # A sampler loaded from another's state reads exactly what the other would read next.
    first = samplers[-1]
    first.epoch, first.consumed = epoch, min(taken, first.per_rank)
    again = ResumableSampler(size, rank=world - 1, world_size=world, seed=seed)
    again.load_state_dict(first.state_dict())
    assert list(again) == list(first) == orders[-1][first.consumed:]


def test_sampler_refuses_another_world_size_or_dataset():
    saved = ResumableSampler(100, rank=0, world_size=2).state_dict()
    with pytest.raises(WorldSizeMismatchError, match="world_size=2"):
        ResumableSampler(100, rank=0, world_size=4).load_state_dict(saved)
    with pytest.raises(ValueError, match="dataset of 100 samples"):
        ResumableSampler(90, rank=0, world_size=2).load_state_dict(saved)


def _ctx(bucket: S3Bucket, agent: FakeAgent, attempt: int, restore_from: Any = None) -> WorkerContext:
    storage = {"endpoint": bucket.endpoint, "access_key": bucket.access_key, "secret_key": bucket.secret_key,
               "bucket": bucket.bucket, "secure": "0"}
    return WorkerContext(job_id=JOB, attempt_id=f"att-{attempt}", attempt_number=attempt,
                         fencing_token=f"tok-{attempt}", agent_url=agent.url, device="cpu",
                         checkpoint={"interval_steps": 4}, restore_from=restore_from, storage=storage,
                         checkpoint_prefix=PREFIX)


def _train(ctx: WorkerContext, *, die_before: int | None = None) -> dict[str, Any] | None:
    """The script a user writes; ``die_before``: stop (as if killed) before that step's work."""
    torch.manual_seed(1000 + ctx.attempt_number)  # a new process starts from other RNG state
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(96, 8, generator=generator)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    with TrainLoop(total_steps=STEPS, seed=3, log_every=5, ctx=ctx) as loop:
        torch.manual_seed(0)
        model = loop.register("model", nn.Linear(8, 1))
        optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        for step, (xb, yb) in loop.steps(loop.data_loader(data, batch_size=8)):
            if step == die_before:
                return None
            noise = torch.randn(1).item() * 1e-3  # uses the RNG: the restored RNG must be the saved one
            loss = F.mse_loss(model(xb), yb) + noise
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss, lr=0.05)
        loop.result(weights_sha256=weights_sha256(model))
        return {"sha": weights_sha256(model), "restored": loop.restored_step, "steps": loop.step}


def test_a_loop_killed_and_restored_ends_with_the_weights_of_one_that_never_stopped(s3_bucket, fake_agent):
    # 96 samples, 8 per step: an epoch is 12 steps, so the 14 steps cross an epoch boundary.
    reference = _train(WorkerContext(device="cpu"))  # no agent, no storage: checkpoints off
    assert reference is not None and reference["restored"] is None

    assert _train(_ctx(s3_bucket, fake_agent, 0), die_before=11) is None
    steps = sorted({s["step"] for s in fake_agent.shards()})
    assert steps == [4, 8]
    plan = {"candidates": [manifest_from_shards(fake_agent.shards(), job_id=JOB, attempt_id="att-0",
                                                attempt_number=0, step=8, world_size=1)]}
    resumed = _train(_ctx(s3_bucket, fake_agent, 1, plan))
    assert resumed == {**reference, "restored": 8}

    progress = [r.body for r in fake_agent.of("progress")]
    assert {p["total_steps"] for p in progress} == {STEPS}
    assert progress[-1]["step"] == STEPS and progress[-1]["metrics"] == {"lr": 0.05}
    [result] = [r.body["result"] for r in fake_agent.of("result")]
    assert result["weights_sha256"] == reference["sha"] and result["steps"] == STEPS


def test_an_unmodified_loop_runs_standalone_and_prints_its_result(capsys):
    out = _train(WorkerContext(device="cpu"))
    printed = capsys.readouterr()
    assert out is not None and out["steps"] == STEPS
    assert f'"weights_sha256": "{out["sha"]}"' in printed.out
    assert f"[trainyard] step={STEPS}/{STEPS}" in printed.err


def test_a_loop_resumed_at_the_end_of_an_epoch_goes_on_with_the_next_one():
    # A save right after an epoch's last batch restores a position with nothing left of that epoch:
    # the loop raised "the data yields no batch" instead of starting the next epoch.
    data = TensorDataset(torch.arange(32.0).unsqueeze(1))  # 4 steps of 8 per epoch

    def run(saved: dict[str, Any] | None) -> list[tuple[int, list[float]]]:
        seen = []
        with TrainLoop(total_steps=7, seed=5, ctx=WorkerContext(device="cpu")) as loop:
            loader = loop.data_loader(data, batch_size=8)
            if saved is not None:
                loop.state.load_state_dict(saved, strict=False)
            for step, (xb,) in loop.steps(loader):
                seen.append((step, xb.flatten().tolist()))
        return seen

    uninterrupted = run(None)
    end_of_epoch = {"step": {"step": 4}, "data": {"version": 1, "size": 32, "world_size": 1, "seed": 5,
                                                   "shuffle": True, "epoch": 0, "consumed": 32}}
    assert [step for step, _ in uninterrupted] == list(range(1, 8))
    assert run(end_of_epoch) == uninterrupted[4:]


# --- issue 26: a stopped loop logs no traceback; a failing step is named ---

_SLEEPY_JOB = """
import time, torch
from torch.utils.data import TensorDataset
from worker_runtime import TrainLoop
with TrainLoop(total_steps=100000, log_every=1) as loop:
    model = loop.register("model", torch.nn.Linear(4, 1))
    data = loop.data_loader(TensorDataset(torch.randn(64, 4)), batch_size=4, num_workers=2, persistent_workers=True)
    for step, (x,) in loop.steps(data):
        model(x).sum().backward()
        if step == 2:
            print("ready", flush=True)
        time.sleep(0.01)
"""


def test_sigterm_to_every_process_several_times_exits_143_without_a_traceback(tmp_path):
    import contextlib
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_SLEEPY_JOB)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # The agent signals every process of the attempt (the DataLoader's workers too: they die of
        # it, torch's way), and the rank shim forwards torchrun's SIGTERM and its own.
        children = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        assert len(children) >= 2  # the DataLoader's workers
        for pid in (proc.pid, *children, proc.pid, proc.pid):
            with contextlib.suppress(ProcessLookupError):  # done already: nothing left to stop
                os.kill(pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # 143, not -15: a later SIGTERM did not kill the process in the middle of its unwinding.
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "Exception ignored" not in err and "SystemExit" not in err, err


@pytest.mark.parametrize("layout", [{"kind": "fsdp"}, {"kind": "hsdp"}, {"kind": "ddp", "compression": "powersgd"}])
def test_loop_ddp_refuses_a_job_whose_layout_is_not_plain_ddp(layout: dict[str, Any]) -> None:
    """A job submitted with an FSDP2 layout whose script calls loop.ddp() would train unsharded (and
    not fit the memory it was planned for): refused before the first step, naming the remedy."""
    from trainyard.protocol.layout import Layout
    from worker_runtime import LayoutError

    with (TrainLoop(total_steps=1, ctx=WorkerContext(layout=Layout(**layout))) as loop,
          pytest.raises(LayoutError, match=r"apply_layout\(model, loop.ctx\)")):
        loop.ddp(nn.Linear(2, 2))
    plain = TrainLoop(total_steps=1, ctx=WorkerContext(layout=Layout(kind="ddp", ddp_bucket_mb=5)))
    with plain as loop:
        model = nn.Linear(2, 2)
        assert loop.ddp(model) is model  # one rank: nothing to wrap
