"""The planner's formulas on hand-computed cases (docs/planner.md): bytes per parameter, parameter
count, activation memory, memory per GPU per layout, bytes per link class, alpha-beta time, compute
time, overlap, the recommendation and a job's verdict. Pure: no database."""

from __future__ import annotations

import pytest

from control_plane.planning import (
    Hardware,
    HardwareOverrides,
    Link,
    PlanningError,
    TransformerShape,
    Workload,
    bytes_per_param,
    check_job,
    estimate,
    find_gpu_kind,
    job_counts,
    plan,
    plan_job,
    read_labels,
    resolve_hardware,
)
from control_plane.planning.catalog import GIB, LABEL_INTER_GBITS, LABEL_INTER_LINK, LABEL_INTRA_LATENCY
from control_plane.planning.workload import layer_activation_bytes
from trainyard.protocol.layout import Layout

MIXED_ADAM = bytes_per_param("bf16-mixed", "adamw")


def flat_hardware(*, gpus_per_node: int = 8, memory_gib: float = 80, tflops: float = 1000,
                  intra: tuple[float, float] = (100e9, 10e-6), inter: tuple[float, float] = (10e9, 20e-6)) -> Hardware:
    """Round figures: intra 100 GB/s and 10 us per step, inter 10 GB/s per GPU and 20 us."""
    return Hardware(gpu_kind="test", memory_bytes=memory_gib * GIB, peak_flops=tflops * 1e12,
                    gpus_per_node=gpus_per_node, intra=Link(name="intra", bytes_per_s=intra[0], latency_s=intra[1]),
                    inter=Link(name="inter", bytes_per_s=inter[0], latency_s=inter[1]))


def params_workload(params: float, **kw: object) -> Workload:
    defaults: dict[str, object] = {"params": params, "bytes": MIXED_ADAM, "seq_len": 2048, "global_batch": 512,
                                   "activation_bytes_per_sample": 0.0}
    defaults.update(kw)
    return Workload(**defaults)  # type: ignore[arg-type]


def test_mixed_precision_adam_is_16_bytes_per_parameter_split_as_documented():
    assert (MIXED_ADAM.weights, MIXED_ADAM.grads, MIXED_ADAM.optimizer) == (2, 2, 12)  # 12 = master 4 + m 4 + v 4
    assert MIXED_ADAM.master == 4 and MIXED_ADAM.replicated_grads == 4 and MIXED_ADAM.autocast_copies == 2
    assert MIXED_ADAM.total == 16
    assert bytes_per_param("fp32", "adamw").total == 16  # 4 + 4 + two fp32 moments
    assert bytes_per_param("bf16", "sgd").total == 4
    assert bytes_per_param("bf16-mixed", "sgd-momentum").total == 2 + 2 + 4 + 4
    with pytest.raises(PlanningError, match="precision"):
        bytes_per_param("int4", "adamw")


def test_7_5b_parameters_are_120_gb_of_state_and_1_9_gb_per_gpu_fully_sharded_over_64():
    w = params_workload(7.5e9)
    assert w.model_state_bytes == 120e9
    row = estimate(w, flat_hardware(), Layout(kind="fsdp"), 64)
    assert row.memory is not None
    assert row.memory.model_state == 1.875e9  # "about 1.9 GB"
    ddp = estimate(w, flat_hardware(), Layout(kind="ddp"), 64)
    assert ddp.memory is not None and ddp.memory.model_state == 120e9
    # DDP runs mixed precision under autocast: fp32 gradients in the reducer's buckets, bf16 weight copies.
    assert ddp.memory.buffers == 7.5e9 * (4 + 2)
    assert not ddp.fits and row.fits


def test_gpt2_small_parameter_count_from_its_shape():
    shape = TransformerShape(layers=12, hidden=768, vocab=50257)
    # 12 layers x (12 h^2 + 13 h) + V h, tied embeddings, no learned positions.
    assert shape.params == 12 * (12 * 768**2 + 13 * 768) + 50257 * 768 == 123_651_840
    assert shape.head_count == 6  # hidden / 128


def test_activation_memory_per_layer_follows_korthikanti():
    shape = TransformerShape(layers=2, hidden=64, vocab=100, heads=4)
    s = 32
    # s*h*(34 + 5*a*s/h) without tensor parallelism, eager attention.
    assert layer_activation_bytes(shape, s, tp=1, flash=False) == s * 64 * 34 + 5 * 4 * s * s
    # s*h*(10 + 24/t + 5*a*s/(h*t)) with degree t = 2.
    assert layer_activation_bytes(shape, s, tp=2, flash=False) == s * 64 * (10 + 12) + 5 * 4 * s * s / 2
    assert layer_activation_bytes(shape, s, tp=1, flash=True) == s * 64 * 34  # no s x s scores
    w = Workload(params=shape.params, bytes=MIXED_ADAM, seq_len=s, global_batch=1, shape=shape)
    logits = 4 * s * 100
    assert w.activations_per_sample() == 2 * s * 64 * 34 + logits
    ckpt = Workload(params=shape.params, bytes=MIXED_ADAM, seq_len=s, global_batch=1, shape=shape,
                    activation_checkpointing=True)
    # Each layer's bf16 input, one layer recomputed, the logits.
    assert ckpt.activations_per_sample() == 2 * (2 * s * 64) + s * 64 * 34 + logits
    measured = params_workload(1e9, activation_bytes_per_sample=3.4e9)
    assert measured.activations_per_sample() == 3.4e9
    assert measured.activations_per_sample(tp=4) == pytest.approx(3.4e9 * (10 + 6) / 34)


def test_ddp_sends_the_ring_all_reduce_share_split_by_link_class():
    p, grads = 1e9, 4.0  # fp32 gradients: DDP's parameters are the master copy under autocast
    w = params_workload(p)
    hw = flat_hardware()
    one_node = estimate(w, hw, Layout(kind="ddp", ddp_bucket_mb=4096), 8)
    assert one_node.traffic is not None
    assert one_node.traffic.intra_bytes == pytest.approx(2 * 7 / 8 * p * grads)
    assert one_node.traffic.inter_bytes == 0
    four_nodes = estimate(w, hw, Layout(kind="ddp", ddp_bucket_mb=4096), 32)
    t = four_nodes.traffic
    assert t is not None
    assert t.total_bytes == pytest.approx(2 * 31 / 32 * p * grads)  # the ring's 2(n-1)/n, whatever the links
    assert t.inter_bytes == pytest.approx(2 * 3 / 4 * p * grads / 8)  # each GPU's 1/8 across the 4 nodes
    assert t.intra_bytes == pytest.approx(2 * 7 / 8 * p * grads)
    compressed = estimate(params_workload(p, bytes=bytes_per_param("fp32", "adamw")), hw,
                          Layout(kind="ddp", compression="bf16"), 8)
    assert compressed.traffic is not None and compressed.traffic.intra_bytes == pytest.approx(2 * 7 / 8 * p * 2)


def test_fsdp_gathers_twice_and_reduce_scatters_once_each_n_minus_1_over_n():
    p = 1e9
    w = params_workload(p, micro_batch=32)  # 512 = 32 x 16: no accumulation
    row = estimate(w, flat_hardware(), Layout(kind="fsdp"), 16)
    assert row.layout.grad_accum_steps == 1 and row.traffic is not None
    weights, grads = 2 * p, 2 * p
    assert row.traffic.total_bytes == pytest.approx(15 / 16 * (2 * weights + grads))
    assert row.traffic.inter_bytes == pytest.approx(1 / 2 * (2 * weights + grads) / 8)
    accumulating = estimate(params_workload(p, micro_batch=8), flat_hardware(), Layout(kind="fsdp"), 16)
    assert accumulating.layout.grad_accum_steps == 4 and accumulating.traffic is not None
    # Parameters are gathered again in every micro-step; gradients are synchronised once.
    assert accumulating.traffic.total_bytes == pytest.approx(15 / 16 * (2 * 4 * weights + grads))
    assert accumulating.memory is not None and row.memory is not None
    assert accumulating.memory.buffers - row.memory.buffers == pytest.approx(p * 2)  # unsharded gradients


def test_fsdp_gathers_the_root_once_per_micro_step_and_each_block_twice():
    # FSDP2 keeps its root (the embeddings) gathered from the forward through the backward.
    shape = TransformerShape(layers=4, hidden=1024, vocab=32000, heads=16)
    p, root = shape.params, shape.embedding_params
    for micro, accum in ((32, 1), (8, 4)):
        w = Workload(params=p, bytes=MIXED_ADAM, seq_len=512, global_batch=512, micro_batch=micro, shape=shape)
        row = estimate(w, flat_hardware(), Layout(kind="fsdp"), 16)
        assert row.layout.grad_accum_steps == accum and row.traffic is not None
        gathered = accum * (2 * p - root) * 2  # bf16 weights: every unit forward, the blocks backward
        assert row.traffic.total_bytes == pytest.approx(15 / 16 * (gathered + p * 2))
        # Collectives: 5 units forward, 4 blocks backward, per micro-step; 5 reduce-scatters per step.
        assert row.collectives == accum * (5 + 4) + 5
    # A parameter count given beside the shape bounds the root (the property test found a negative).
    small = Workload(params=1e6, bytes=MIXED_ADAM, seq_len=512, global_batch=512, micro_batch=32, shape=shape)
    tiny = estimate(small, flat_hardware(), Layout(kind="fsdp"), 16)
    assert tiny.traffic is not None and tiny.traffic.total_bytes == pytest.approx(15 / 16 * (1e6 * 2 + 1e6 * 2))


def test_hsdp_shards_inside_a_node_and_all_reduces_the_shard_across_nodes():
    p = 1e9
    row = estimate(params_workload(p, micro_batch=32), flat_hardware(), Layout(kind="hsdp"), 16)
    assert row.layout.shard_size == 8 and row.data_parallel == 16  # sharding keeps every GPU a data rank
    t, m = row.traffic, row.memory
    assert t is not None and m is not None
    assert m.model_state == p * 16 / 8
    assert t.intra_bytes == pytest.approx(7 / 8 * (2 * 2 * p + 2 * p))
    assert t.inter_bytes == pytest.approx(2 * 1 / 2 * 2 * p / 8)  # all-reduce of a 1/8 shard over 2 replicas
    bad = estimate(params_workload(p), flat_hardware(), Layout(kind="hsdp", shard_size=3), 16)
    assert bad.problem and "do not divide" in bad.problem and not bad.feasible


def test_alpha_beta_time_and_compute_time_on_round_numbers():
    p = 1e9
    w = params_workload(p, global_batch=8, seq_len=1000, mfu=0.5)
    hw = flat_hardware()
    row = estimate(w, hw, Layout(kind="ddp", ddp_bucket_mb=4096), 4)  # one bucket: 4 GB < 4 GiB
    assert row.collectives == 1
    # 2(g-1) ring steps of 10 us and 2(g-1)/g x 4 GB of fp32 gradients at 100 GB/s.
    assert row.comm_s == pytest.approx(6 * 10e-6 + 2 * 3 / 4 * 4e9 / 100e9)
    # 6 x params x tokens over 4 GPUs at 1 PFLOP/s x 50%.
    assert row.compute_s == pytest.approx(6 * p * 8000 / (4 * 1e15 * 0.5))
    # One bucket fires when backward ends: nothing overlaps.
    assert row.exposed_comm_s == pytest.approx(row.comm_s)
    assert row.step_s == pytest.approx(row.compute_s + row.comm_s)
    assert row.tokens_per_s == pytest.approx(8000 / row.step_s)
    bucketed = estimate(w, hw, Layout(kind="ddp", ddp_bucket_mb=25), 4)
    assert bucketed.collectives == 153  # ceil(4e9 / 25 MiB)
    assert bucketed.comm_s == pytest.approx(153 * 6 * 10e-6 + 2 * 3 / 4 * 4e9 / 100e9)
    assert bucketed.exposed_comm_s is not None and bucketed.exposed_comm_s < bucketed.comm_s  # overlapped
    recompute = estimate(params_workload(p, global_batch=8, seq_len=1000, mfu=0.5, activation_checkpointing=True),
                         hw, Layout(kind="ddp"), 4)
    assert recompute.compute_s == pytest.approx(row.compute_s * 8 / 6)


def test_tensor_parallel_inside_a_node_and_data_parallel_across():
    shape = TransformerShape(layers=4, hidden=1024, vocab=1000, heads=16)
    w = Workload(params=shape.params, bytes=MIXED_ADAM, seq_len=512, global_batch=8, micro_batch=1, shape=shape)
    row = estimate(w, flat_hardware(), Layout(kind="tp_dp", tp_size=8), 64)
    assert row.data_parallel == 8 and row.layout.grad_accum_steps == 1
    assert row.memory is not None and row.memory.model_state == pytest.approx(shape.params * 16 / 8)
    t = row.traffic
    assert t is not None
    tp_bytes = 4 * 4 * 2 * 7 / 8 * (512 * 1024 * 2)  # 4 layers x 4 all-reduces of the bf16 activations
    dp_bytes = 2 * 7 / 8 * shape.params * 4 / 8  # the 1/8 shard's fp32 gradients over 8 nodes, one GPU each
    assert t.intra_bytes == pytest.approx(tp_bytes)
    assert t.inter_bytes == pytest.approx(dp_bytes)
    assert estimate(params_workload(1e9), flat_hardware(), Layout(kind="tp_dp", tp_size=8), 8).problem


def test_batch_that_does_not_divide_is_a_row_problem_not_an_error():
    row = estimate(params_workload(1e9, global_batch=100, micro_batch=4), flat_hardware(), Layout(kind="ddp"), 8)
    assert row.problem == "global batch 100 is not a multiple of micro batch 4 x 8 data-parallel ranks"
    assert row.tokens_per_s is None and not row.feasible


def test_recommendation_skips_what_does_not_fit_and_says_why():
    w = params_workload(7.5e9, seq_len=4096, micro_batch=1)
    hw = resolve_hardware("h100", 8)
    result = plan(w, hw, [Layout(kind="ddp"), Layout(kind="fsdp"), Layout(kind="hsdp")], [8, 16, 32, 64],
                  min_efficiency=0.7)
    best = result.recommendation.row
    assert best is not None and best.layout.kind != "ddp" and best.feasible
    assert "ddp does not fit (needs 165.0 GB per GPU" in result.recommendation.reason
    first = [r for r in result.rows if r.layout.kind == best.layout.kind and r.feasible][0]
    assert first.scaling_efficiency == 1.0
    with pytest.raises(PlanningError) as nothing:
        plan(params_workload(1e12), hw, [Layout(kind="ddp")], [8], min_efficiency=0.7)
    assert nothing.value.numbers["least_memory_bytes"] > nothing.value.numbers["usable_memory_bytes"]


def test_a_job_that_does_not_fit_is_refused_with_the_numbers():
    rows = [estimate(params_workload(7.5e9), flat_hardware(), Layout(kind="ddp"), n) for n in (8, 16)]
    with pytest.raises(PlanningError) as refused:
        check_job(rows, 16, min_efficiency=0.7)
    numbers = refused.value.numbers
    assert numbers["model_state_bytes"] == 120_000_000_000 and numbers["needed_bytes"] > numbers["usable_bytes"]
    assert "does not fit in GPU memory on 16 GPUs" in str(refused.value)


def test_a_job_on_a_slow_network_is_warned_about_the_count_that_does_better():
    # A small model over 1 Gbit/s Ethernet: a second node adds more communication than compute.
    w = params_workload(1e9, seq_len=1024, global_batch=64, micro_batch=1)
    hw = resolve_hardware("h100", 8, overrides=HardwareOverrides(inter_link="ethernet", inter_gbits_per_s=1))
    rows, mine, warnings = plan_job(w, hw, Layout(kind="ddp", grad_accum_steps=4), num_nodes=2, gpus_per_node=8,
                                    min_efficiency=0.7)
    assert [r.gpus for r in rows] == job_counts(2, 8) == [1, 2, 4, 8, 16]
    assert mine.gpus == 16
    kinds = {x.kind: x for x in warnings}
    assert kinds["throughput"].better_gpus == 8 and "less than 8 GPUs" in kinds["throughput"].message
    assert kinds["efficiency"].better_gpus == 8
    quiet = plan_job(w, resolve_hardware("h100", 8), Layout(kind="ddp", grad_accum_steps=4), num_nodes=2,
                     gpus_per_node=8, min_efficiency=0.5)[2]
    assert quiet == []


def test_gpu_kinds_as_nodes_report_them():
    assert find_gpu_kind("NVIDIA H100 80GB HBM3").name == "h100-sxm"  # type: ignore[union-attr]
    assert find_gpu_kind("NVIDIA H100 PCIe").name == "h100-pcie"  # type: ignore[union-attr]
    assert find_gpu_kind("NVIDIA A100-SXM4-40GB").name == "a100-sxm"  # type: ignore[union-attr]
    assert find_gpu_kind("NVIDIA L4").name == "l4"  # type: ignore[union-attr]
    assert find_gpu_kind("NVIDIA L40S").name == "l40s"  # type: ignore[union-attr]
    assert find_gpu_kind("virtual-cpu").name == "virtual-cpu"  # type: ignore[union-attr]
    assert find_gpu_kind("Tesla K80") is None


def test_labels_are_read_conservatively_and_bad_ones_ignored_with_a_note():
    reading = read_labels([
        ("a", {LABEL_INTER_GBITS: "400", LABEL_INTER_LINK: "roce", LABEL_INTRA_LATENCY: "2"}),
        ("b", {LABEL_INTER_GBITS: "200", LABEL_INTER_LINK: "RoCE", LABEL_INTRA_LATENCY: "5"}),
        ("c", {LABEL_INTER_GBITS: "fast", LABEL_INTER_LINK: "carrier-pigeon", "rack": "r1"}),
    ])
    assert reading.numbers == {LABEL_INTER_GBITS: 200.0, LABEL_INTRA_LATENCY: 5.0}  # slowest, largest latency
    assert reading.links == {LABEL_INTER_LINK: "roce"}
    assert len(reading.notes) == 2 and all(n.startswith("node c:") for n in reading.notes)


def test_hardware_figures_come_from_request_then_labels_then_nodes_then_catalog():
    labels = read_labels([("a", {LABEL_INTER_GBITS: "800", LABEL_INTER_LINK: "ethernet"})])
    hw = resolve_hardware("NVIDIA H100 80GB HBM3", 8, labels=labels, reported_memory_mib=81559)
    assert hw.memory_bytes == 81559 * 2**20 and hw.sources["memory"] == "reported by the nodes"
    assert hw.peak_flops == 989e12 and hw.sources["peak_flops"] == "catalog (h100-sxm)"
    assert hw.inter.name == "ethernet" and hw.inter.bytes_per_s == pytest.approx(800e9 / 8 * 0.6 / 8)
    assert hw.sources["inter_bandwidth"] == f"label {LABEL_INTER_GBITS}"
    assert hw.intra.name == "nvlink4" and hw.intra.bytes_per_s == pytest.approx(450e9 * 0.8)
    mine = resolve_hardware("h100", 8, labels=labels, overrides=HardwareOverrides(
        inter_gbits_per_s=100, link_efficiency=1.0, gpu_memory_gib=40))
    assert mine.inter.bytes_per_s == pytest.approx(100e9 / 8 / 8) and mine.memory_bytes == 40 * GIB
    assert mine.sources["inter_bandwidth"] == "request"
    with pytest.raises(PlanningError, match="not in the planner's catalog"):
        resolve_hardware("Tesla K80", 8)
    unknown = resolve_hardware("Tesla K80", 8, overrides=HardwareOverrides(gpu_memory_gib=12, peak_tflops=8))
    assert unknown.intra.name == "pcie4" and unknown.inter.name == "ethernet"
