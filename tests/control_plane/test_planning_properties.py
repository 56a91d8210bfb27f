"""The planner's monotonic properties and its fuzzing (hypothesis, bounded): more shards never need
more memory per GPU, more DDP replicas never send fewer bytes, overlap never makes a step slower,
and no input at all makes it fail other than with a PlanningError, or return a figure that is not
finite. Pure: no database."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.planning import (
    BytesPerParam,
    Hardware,
    Link,
    PlanningError,
    Row,
    TransformerShape,
    Workload,
    bytes_per_param,
    estimate,
    plan,
)
from control_plane.planning.catalog import GIB
from trainyard.protocol.layout import Layout

MIXED_ADAM = bytes_per_param("bf16-mixed", "adamw")
PER_NODE = st.sampled_from([1, 2, 4, 8])


def hardware(per_node: int) -> Hardware:
    return Hardware(gpu_kind="test", memory_bytes=80 * GIB, peak_flops=1e15, gpus_per_node=per_node,
                    intra=Link(name="intra", bytes_per_s=300e9, latency_s=3e-6),
                    inter=Link(name="inter", bytes_per_s=25e9, latency_s=10e-6))


def counts(per_node: int) -> list[int]:
    """Counts that place: parts of a node in powers of two, then whole nodes."""
    return sorted({n for n in (1, 2, 4, 8) if n <= per_node} | {per_node * m for m in (1, 2, 3, 4, 8, 16)})


@st.composite
def workloads(draw: st.DrawFn, *, micro: bool = True) -> Workload:
    """A workload whose global batch divides over every count above, so every row is sized."""
    params = draw(st.floats(1e6, 1e12))
    per_sample = draw(st.floats(0, 1e10))
    micro_batch = draw(st.integers(1, 8)) if micro else None
    return Workload(params=params, bytes=MIXED_ADAM, seq_len=draw(st.integers(1, 8192)),
                    global_batch=(micro_batch or 1) * 3 * 128 * draw(st.integers(1, 4)), micro_batch=micro_batch,
                    activation_bytes_per_sample=per_sample, mfu=draw(st.floats(0.05, 1)))


def total_memory(row: Row) -> float:
    assert row.memory is not None, row.problem
    return row.memory.total


@settings(max_examples=60, deadline=None)
@given(w=workloads(), per_node=PER_NODE, micro=st.booleans())
def test_more_shards_never_need_more_memory_per_gpu(w: Workload, per_node: int, micro: bool) -> None:
    hw = hardware(per_node)
    if not micro:
        w = Workload(**{**w.__dict__, "micro_batch": None})
    fsdp = [total_memory(estimate(w, hw, Layout(kind="fsdp"), n)) for n in counts(per_node)]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(fsdp, fsdp[1:], strict=False)), fsdp
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s <= 4 * per_node and (s <= per_node or s % per_node == 0)
             and (per_node % s == 0 or s % per_node == 0)]
    hsdp = [total_memory(estimate(w, hw, Layout(kind="hsdp", shard_size=s), 4 * per_node)) for s in sizes]
    assert all(later <= earlier * (1 + 1e-12) for earlier, later in zip(hsdp, hsdp[1:], strict=False)), hsdp


@settings(max_examples=60, deadline=None)
@given(w=workloads(), per_node=PER_NODE, bucket=st.floats(1, 4096))
def test_more_ddp_replicas_never_send_fewer_bytes_per_step(w: Workload, per_node: int, bucket: float) -> None:
    hw = hardware(per_node)
    rows = [estimate(w, hw, Layout(kind="ddp", ddp_bucket_mb=bucket), n) for n in counts(per_node)]
    for key in ("total_bytes", "intra_bytes", "inter_bytes"):
        sent = [getattr(r.traffic, key) for r in rows]
        assert all(later >= earlier * (1 - 1e-12) for earlier, later in zip(sent, sent[1:], strict=False)), (key, sent)


@settings(max_examples=60, deadline=None)
@given(w=workloads(), per_node=PER_NODE,
       layout=st.sampled_from([Layout(kind="ddp"), Layout(kind="fsdp"), Layout(kind="hsdp"),
                               Layout(kind="ddp", compression="bf16")]))
def test_overlap_never_makes_a_step_slower_and_compute_divides_over_gpus(
        w: Workload, per_node: int, layout: Layout) -> None:
    hw = hardware(per_node)
    rows = [estimate(w, hw, layout, n) for n in counts(per_node)]
    for row in rows:
        assert row.step_s is not None and row.step_s_no_overlap is not None and row.comm_s is not None
        assert row.exposed_comm_s is not None and 0 <= row.exposed_comm_s <= row.comm_s * (1 + 1e-12)
        assert row.step_s <= row.step_s_no_overlap * (1 + 1e-12)
        assert row.compute_s is not None
        assert math.isclose(row.compute_s * row.gpus, rows[0].compute_s * rows[0].gpus, rel_tol=1e-9)  # type: ignore[operator]


def _finite(row: Row) -> None:
    numbers = [row.usable_memory, row.collectives]
    numbers += [getattr(row, k) for k in ("compute_s", "comm_s", "exposed_comm_s", "step_s_no_overlap", "step_s",
                                          "tokens_per_s", "scaling_efficiency") if getattr(row, k) is not None]
    if row.memory:
        numbers += [row.memory.model_state, row.memory.buffers, row.memory.activations]
    if row.traffic:
        numbers += [row.traffic.intra_bytes, row.traffic.inter_bytes]
    assert all(math.isfinite(x) and x >= 0 for x in numbers), row


@st.composite
def within_limits(draw: st.DrawFn) -> tuple[Workload, Hardware, list[Layout], list[int]]:
    """Anything the limits allow (planning/workload.py LIMITS, Hardware's checks; the API's schema
    says the same), extremes included."""
    shape = None
    if draw(st.booleans()):
        hidden = draw(st.one_of(st.integers(1, 1_000_000), st.sampled_from([64, 768, 4096, 16384])))
        heads = draw(st.one_of(st.none(), st.sampled_from([d for d in (1, 2, 4, 8, 16, 64, 128) if hidden % d == 0])))
        shape = TransformerShape(layers=draw(st.integers(1, 100_000)), hidden=hidden,
                                 vocab=draw(st.integers(0, 100_000_000)), heads=heads)
    given_activations = st.floats(0, 1e15)
    micro = draw(st.one_of(st.none(), st.integers(1, 1_000_000), st.sampled_from([1, 2, 8])))
    # Mostly a batch that divides over power-of-two counts, so that rows get sized and timed.
    batch = draw(st.one_of(st.integers(1, 100_000_000),
                           st.integers(0, 16).map(lambda e: (micro or 1) * 2**e)))
    w = Workload(
        params=draw(st.floats(1, 1e15)), bytes=draw(st.builds(
            BytesPerParam, weights=st.floats(0, 256), grads=st.floats(0, 256), optimizer=st.floats(0, 256))),
        seq_len=draw(st.integers(1, 10_000_000)), global_batch=min(batch, 100_000_000), micro_batch=micro, shape=shape,
        activation_bytes_per_sample=draw(
            given_activations if shape is None else st.one_of(st.none(), given_activations)),
        activation_checkpointing=draw(st.booleans()), flash_attention=draw(st.booleans()),
        activation_dtype_bytes=draw(st.sampled_from([2, 4])), mfu=draw(st.floats(1e-3, 1)))
    per_node = draw(st.one_of(st.integers(1, 64), st.sampled_from([1, 2, 4, 8])))
    hw = Hardware(gpu_kind="x", memory_bytes=draw(st.floats(1e6, 1e17)), peak_flops=draw(st.floats(1e6, 1e18)),
                  gpus_per_node=per_node, memory_reserve=draw(st.floats(0, 0.99)),
                  intra=Link(name="i", bytes_per_s=draw(st.floats(1e3, 1e15)), latency_s=draw(st.floats(0, 1))),
                  inter=Link(name="e", bytes_per_s=draw(st.floats(1e3, 1e15)), latency_s=draw(st.floats(0, 1))))
    layouts = draw(st.lists(st.builds(
        Layout, kind=st.sampled_from(["ddp", "fsdp", "hsdp", "tp_dp"]), grad_accum_steps=st.integers(1, 4096),
        ddp_bucket_mb=st.floats(1e-6, 4096), compression=st.sampled_from(["none", "bf16", "fp16", "powersgd"]),
        powersgd_rank=st.integers(1, 64), shard_size=st.one_of(st.none(), st.integers(1, 4096)),
        tp_size=st.integers(1, 64)), min_size=1, max_size=4))
    gpu_counts = draw(st.lists(st.one_of(st.integers(1, 1_000_000), st.integers(0, 10).map(lambda e: 2**e)),
                               min_size=1, max_size=8))
    return w, hw, layouts, gpu_counts


@settings(max_examples=300, deadline=None)
@given(inputs=within_limits(), min_efficiency=st.floats(0, 1))
def test_no_input_fails_other_than_with_a_planning_error(
        inputs: tuple[Workload, Hardware, list[Layout], list[int]], min_efficiency: float) -> None:
    w, hw, layouts, gpu_counts = inputs
    try:
        result = plan(w, hw, layouts, gpu_counts, min_efficiency=min_efficiency)
    except PlanningError:
        return
    for row in result.rows:
        _finite(row)
    assert result.recommendation.reason


@settings(max_examples=100, deadline=None)
@given(params=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-1e20, 1e20)),
       mfu=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-2, 2)))
def test_inputs_outside_the_limits_are_refused_with_a_planning_error(params: float, mfu: float) -> None:
    try:
        Workload(params=params, bytes=MIXED_ADAM, seq_len=1, global_batch=1, activation_bytes_per_sample=0.0, mfu=mfu)
    except PlanningError as exc:
        assert exc.field in ("params", "mfu")
    else:
        assert 1 <= params <= 1e15 and 1e-3 <= mfu <= 1
