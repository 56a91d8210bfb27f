"""The layout a worker reads and applies, and the meter that splits its steps (no process group:
the layouts under torchrun are in test_tiny_gpt.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainyard.protocol.layout import METRIC_COMM_BYTES, METRIC_COMM_S, METRIC_COMPUTE_S, METRIC_STEP_S, Layout
from worker_runtime import WorkerContext
from worker_runtime.comm_meter import METRIC_COMM_BUSY_S, CommMeter
from worker_runtime.examples.tiny_gpt_model import TinyGPT
from worker_runtime.grads import PendingGrads
from worker_runtime.layouts import LayoutError, ParallelModel, apply_layout, default_units, mesh_shape
from worker_runtime.state import TrainState


def test_context_reads_the_layout() -> None:
    assert WorkerContext.from_env({"TRAINYARD_DEVICE": "cpu"}).layout == Layout()  # absent: plain DDP
    raw = {"kind": "hsdp", "grad_accum_steps": 4, "shard_size": 8}
    ctx = WorkerContext.from_env({"TRAINYARD_DEVICE": "cpu", "TRAINYARD_LAYOUT": json.dumps(raw)})
    assert (ctx.layout.kind, ctx.layout.grad_accum_steps, ctx.layout.shard_size) == ("hsdp", 4, 8)
    with pytest.raises(ValueError, match=r"TRAINYARD_LAYOUT is not a valid layout: kind: .*"):
        WorkerContext.from_env({"TRAINYARD_DEVICE": "cpu", "TRAINYARD_LAYOUT": '{"kind": "zero9"}'})
    with pytest.raises(ValueError, match="TRAINYARD_LAYOUT is not valid JSON"):
        WorkerContext.from_env({"TRAINYARD_DEVICE": "cpu", "TRAINYARD_LAYOUT": "{"})


def test_planned_only_layouts_are_refused() -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(LayoutError, match="'tp_dp' is planned only: the worker runtime applies ddp, fsdp, hsdp"):
        apply_layout(model, WorkerContext(device="cpu"), Layout(kind="tp_dp", tp_size=2))


def test_mesh_shapes() -> None:
    assert mesh_shape(Layout(kind="fsdp"), 16, 8) == (16,)
    assert mesh_shape(Layout(kind="hsdp"), 16, 8) == (2, 8)  # shard inside a node, replicate across
    assert mesh_shape(Layout(kind="hsdp", shard_size=4), 16, 8) == (4, 4)
    with pytest.raises(LayoutError, match="shard size 3 does not divide the 16 ranks"):
        mesh_shape(Layout(kind="hsdp", shard_size=3), 16, 8)


def test_fsdp_shards_each_block_then_the_root() -> None:
    model = TinyGPT(vocab=16, max_len=8, d_model=8, layers=3, heads=2)
    assert default_units(model) == list(model.blocks)


def test_standalone_accumulation_meters_steps_without_collectives() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    parallel = apply_layout(model, WorkerContext(device="cpu"), Layout(grad_accum_steps=3))
    assert parallel.module is model and parallel.accum_steps == 3
    for _ in range(2):
        with parallel.meter.step():
            for micro in range(parallel.accum_steps):
                with parallel.micro_step(micro):
                    model(torch.randn(4, 8)).sum().backward()
    metrics = parallel.meter.summary()
    assert metrics[METRIC_COMM_S] == 0 and metrics[METRIC_COMM_BYTES] == 0
    assert metrics[METRIC_STEP_S] == metrics[METRIC_COMPUTE_S] > 0
    assert parallel.meter.summary() == {}  # the window starts again


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_meter_splits_blocking_and_overlapped_collectives() -> None:
    clock = Clock()
    meter = CommMeter("cpu", clock=clock)
    assert meter.launched(10) is None  # not inside a step: not counted
    with meter.step():
        with meter.blocking(100):  # e.g. an FSDP2 all-gather: the caller waits for all of it
            clock.sleep(2)
        first = meter.launched(1000)  # DDP buckets: launched during the backward...
        clock.sleep(3)  # ...overlapping the rest of it
        last = meter.launched(500)
        clock.sleep(0.5)
        meter.completed(first)
        clock.sleep(0.5)
        meter.completed(last)  # the backward waited from the last launch to here
        meter.sync_point()
        clock.sleep(1)  # the optimizer
    [split] = meter.splits()
    assert split.comm_bytes == 1600
    assert split.step_s == 7
    # Exposed: the blocking collective and the tail after the last launch, not the overlapped 3 s.
    assert split.comm_s == 2 + 1
    assert split.compute_s == 4
    # Busy: the blocking one plus the union of the two buckets.
    assert split.comm_busy_s == 2 + 4


def test_meter_summary_averages_the_window() -> None:
    meter = CommMeter("cpu")
    for nbytes in (100, 300):
        with meter.step(), meter.blocking(nbytes):
            pass
    summary = meter.summary()
    assert summary[METRIC_COMM_BYTES] == 200
    assert set(summary) == {METRIC_STEP_S, METRIC_COMPUTE_S, METRIC_COMM_S, METRIC_COMM_BUSY_S, METRIC_COMM_BYTES}


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[WorkerContext]:
    """A real gloo process group of one rank in this process (DDP wraps and runs its hooks)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield WorkerContext(device="cpu")
    finally:
        dist.destroy_process_group()


def test_ddp_takes_the_layouts_bucket_size_and_compression(one_rank_group: WorkerContext) -> None:
    def one_step(layout: Layout) -> tuple[int, int]:
        torch.manual_seed(0)
        model = TinyGPT(vocab=32, max_len=8, d_model=32, layers=2, heads=2)
        params = sum(p.numel() for p in model.parameters())
        parallel = apply_layout(model, one_rank_group, layout)
        parallel.settle(torch.zeros(1, 8, dtype=torch.long))  # DDP's first backward is one bucket
        with parallel.meter.step(), parallel.micro_step(0):
            parallel.module(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
        [split] = parallel.meter.splits()
        assert split.comm_bytes == params * (2 if layout.compression in ("fp16", "bf16") else 4)
        del parallel  # DDP goes before its process group
        return split.collectives, params

    buckets, params = one_step(Layout())  # 25 MiB: the whole model in one bucket
    small, _ = one_step(Layout(ddp_bucket_mb=4 * params / 4 / 2**20))  # about a quarter of it
    assert buckets == 1 and small >= 4
    assert one_step(Layout(compression="fp16"))[0] == 1


@pytest.mark.parametrize("compression", ["none", "bf16"])
def test_fsdp2_gradients_of_a_cut_accumulation_window_are_checkpointed(one_rank_group: WorkerContext,
                                                                       compression: str) -> None:
    """With sync off FSDP2 accumulates each rank's gradients unsharded (in its reduce dtype with
    compression), not in ``param.grad``: a checkpoint inside the window must still hold them, and
    a new process (its unsharded parameters not yet all-gathered) must get them back (issue 24)."""
    layout = Layout(kind="fsdp", grad_accum_steps=2, compression=compression)  # type: ignore[arg-type]
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def build() -> tuple[ParallelModel, torch.optim.Optimizer, TrainState]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        parallel = apply_layout(model, one_rank_group, layout, units=[model[0]])
        state = TrainState()
        state.register("model", model)
        optimizer = state.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        state.register("grads", PendingGrads(state), per_rank=True).watch()
        return parallel, optimizer, state

    def micro_step(parallel: ParallelModel, index: int) -> None:
        with parallel.micro_step(index):
            parallel.module(batches[index]).square().mean().backward()

    def weights(parallel: ParallelModel) -> list[torch.Tensor]:
        return [p.full_tensor() for p in parallel.model.parameters()]  # type: ignore[attr-defined]

    parallel, optimizer, state = build()
    micro_step(parallel, 0)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    micro_step(parallel, 1)
    optimizer.step()
    expected = weights(parallel)

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["grads"]["grads"] == {}  # nothing in param.grad: FSDP2 holds the window
    assert len(saved["grads"]["fsdp"]["unsharded" if compression == "none" else "accumulated"]) == 4
    resumed, optimizer, state = build()
    state.load_state_dict(saved)
    micro_step(resumed, 1)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(expected, weights(resumed), strict=True))
