"""One row of a plan: a layout on a number of GPUs, its memory per GPU, its traffic per link class,
its step time with and without overlap. Pure: standard library and the wire contract only.
The model and its limits: docs/planner.md."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from control_plane.planning.collectives import Group, Traffic, all_gather, all_reduce, reduce_scatter
from control_plane.planning.hardware import Hardware
from control_plane.planning.workload import Workload
from trainyard.protocol.layout import Layout

MIB = 2**20


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Peak bytes on one GPU."""

    model_state: float
    """This GPU's share of weights, gradients and optimizer state."""
    buffers: float
    """DDP's gradient buckets and autocast's weight copies; FSDP's gathered units; gradients
    accumulated unsharded."""
    activations: float

    @property
    def total(self) -> float:
        return self.model_state + self.buffers + self.activations


@dataclass(frozen=True, kw_only=True)
class Row:
    layout: Layout
    """The layout as the runtime would apply it (grad_accum_steps, shard_size, tp_size resolved)."""
    gpus: int
    nodes: int
    gpus_per_node: int
    data_parallel: int = 0
    micro_batch: int | None = None
    memory: Memory | None = None
    usable_memory: float = 0.0
    traffic: Traffic | None = None
    """Per GPU per optimizer step."""
    collectives: float = 0.0
    compute_s: float | None = None
    comm_s: float | None = None
    exposed_comm_s: float | None = None
    step_s_no_overlap: float | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    scaling_efficiency: float | None = None
    problem: str | None = None
    """Why this layout cannot run on this count (None: it can)."""

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.memory.total <= self.usable_memory

    @property
    def feasible(self) -> bool:
        return self.problem is None and self.fits and self.tokens_per_s is not None

    @property
    def tokens_per_s_per_gpu(self) -> float | None:
        return self.tokens_per_s / self.gpus if self.tokens_per_s is not None else None


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB"


def _placement(gpus: int, hw: Hardware) -> tuple[int, int] | str:
    """(nodes, GPUs per node) of ``gpus``: a part of one node or whole nodes."""
    if gpus <= hw.gpus_per_node:
        return 1, gpus
    if gpus % hw.gpus_per_node:
        return f"{gpus} GPUs are not a whole number of {hw.gpus_per_node}-GPU nodes"
    return gpus // hw.gpus_per_node, hw.gpus_per_node


def _groups(layout: Layout, gpus: int, nodes: int, per_node: int) -> tuple[Group, Group, int] | str:
    """(the group a parameter is sharded or split over, the group of its replicas, the data-parallel
    ranks the batch is split over). Sharding (FSDP, HSDP) keeps every GPU a data-parallel rank;
    tensor parallelism makes its group one."""
    everyone, alone = Group(per_node, nodes), Group(1, 1)
    if layout.kind == "ddp":
        return alone, everyone, gpus
    if layout.kind == "fsdp":
        return everyone, alone, gpus
    if layout.kind == "hsdp":
        size = layout.shard_size or per_node
        if size > gpus or gpus % size:
            return f"hsdp shard groups of {size} do not divide {gpus} GPUs"
        if size <= per_node:
            if per_node % size:
                return f"hsdp shard groups of {size} do not divide a node's {per_node} GPUs"
            return Group(size, 1), Group(per_node // size, nodes), gpus
        if size % per_node:
            return f"hsdp shard groups of {size} GPUs are not whole {per_node}-GPU nodes"
        return Group(per_node, size // per_node), Group(1, gpus // size), gpus
    tp = layout.tp_size
    if tp > per_node or per_node % tp:
        return f"tensor-parallel degree {tp} does not divide the {per_node} GPUs of a node"
    return Group(tp, 1), Group(per_node // tp, nodes), gpus // tp


def _exposed(comm_s: float, window_s: float, pieces: float) -> float:
    """Communication left over once it overlaps a window of compute; the last piece never overlaps."""
    return max(comm_s - window_s, comm_s / max(pieces, 1.0))


def estimate(w: Workload, hw: Hardware, layout: Layout, gpus: int) -> Row:
    """The row of ``layout`` on ``gpus`` GPUs (its ``grad_accum_steps`` is derived from the batch)."""
    usable = hw.usable_memory_bytes
    placed = _placement(gpus, hw)
    if isinstance(placed, str):
        return Row(layout=layout, gpus=gpus, nodes=0, gpus_per_node=0, usable_memory=usable, problem=placed)
    nodes, per_node = placed
    base = Row(layout=layout, gpus=gpus, nodes=nodes, gpus_per_node=per_node, usable_memory=usable)
    groups = _groups(layout, gpus, nodes, per_node)
    if isinstance(groups, str):
        return replace(base, problem=groups)
    split, replicas, dp = groups
    tp = split.size if layout.kind == "tp_dp" else 1
    if layout.kind == "tp_dp" and w.shape is None:
        return replace(base, problem="tensor parallel needs the transformer shape (layers, hidden)")
    if tp > 1 and w.shape is not None and w.shape.head_count % tp:
        return replace(base, problem=f"{w.shape.head_count} attention heads do not split over {tp} GPUs")
    if layout.compression != "none" and layout.kind != "ddp":
        return replace(base, problem="gradient compression applies to ddp only")

    # Batch: each data-parallel rank takes micro_batch samples per micro-step.
    micro = w.micro_batch if w.micro_batch is not None else w.global_batch // dp
    if micro < 1 or w.global_batch % (micro * dp):
        return replace(base, data_parallel=dp, problem=(
            f"global batch {w.global_batch} is not a multiple of micro batch {max(micro, 1)} x {dp} "
            "data-parallel ranks"))
    accum = w.global_batch // (micro * dp)
    layout = layout.model_copy(update={"grad_accum_steps": accum, **(
        {"shard_size": split.size} if layout.kind == "hsdp" else {})})
    base = replace(base, layout=layout, data_parallel=dp, micro_batch=micro)

    p, b = w.params, w.bytes
    activations = micro * w.activations_per_sample(tp)
    unit = w.largest_unit_params
    # Gathered parameters of the unit computing and the one prefetched, and one unit's full gradient.
    gathered = unit * (2 * b.weights + b.grads)
    accumulated = p * b.grads if accum > 1 else 0.0  # no gradient sync on inner micro-steps
    if layout.kind in ("ddp", "tp_dp"):
        # The reducer's buckets hold a second copy of the gradients (gradient_as_bucket_view off),
        # and autocast keeps 16-bit copies of the weights for backward.
        memory = Memory(model_state=p * b.total / tp, buffers=p * (b.replicated_grads + b.autocast_copies) / tp,
                        activations=activations)
    else:
        memory = Memory(model_state=p * b.total / split.size, buffers=gathered + accumulated,
                        activations=activations)

    compute_s = w.flops_per_token * w.tokens_per_step / (gpus * hw.peak_flops * w.mfu)
    comm = (_replicated(w, hw, layout, split, replicas, micro, accum, compute_s) if layout.kind in ("ddp", "tp_dp")
            else _sharded(w, hw, split, replicas, accum, compute_s))
    if isinstance(comm, str):
        return replace(base, memory=memory, problem=comm)
    traffic, collectives, comm_s, exposed = comm
    step_s = compute_s + exposed
    return replace(
        base, memory=memory, traffic=traffic, collectives=collectives, compute_s=compute_s, comm_s=comm_s,
        exposed_comm_s=exposed, step_s_no_overlap=compute_s + comm_s, step_s=step_s,
        tokens_per_s=w.tokens_per_step / step_s,
    )


Comm = tuple[Traffic, float, float, float]
"""(traffic per GPU, collectives, seconds one after the other, seconds left exposed by overlap)."""


def _with_steps(traffic: Traffic, times: float) -> Traffic:
    """The traffic of one buffer moved in ``times`` collectives: the same bytes, each one's ring steps."""
    return replace(traffic, intra_steps=traffic.intra_steps * times, inter_steps=traffic.inter_steps * times)


def _replicated(w: Workload, hw: Hardware, layout: Layout, split: Group, replicas: Group, micro: int, accum: int,
                compute_s: float) -> Comm | str:
    """ddp, and tp_dp's data-parallel part: one gradient all-reduce per step in buckets, overlapping
    the backward of the last micro-step; tp_dp adds Megatron's all-reduces inside the node."""
    shard_params = w.params / split.size if layout.kind == "tp_dp" else w.params
    wire = _gradient_wire_bytes(w, layout, shard_params)
    if wire is None:
        return "powersgd needs the transformer shape (layers, hidden)"
    # At most one bucket per parameter (a bucket holds whole tensors): bounds a tiny bucket size.
    buckets = float(max(1, math.ceil(min(shard_params * w.bytes.replicated_grads / (layout.ddp_bucket_mb * MIB),
                                         shard_params))))
    traffic = _with_steps(all_reduce(wire, replicas), buckets)
    comm_s = traffic.seconds(hw)
    exposed = _exposed(comm_s, compute_s / accum * w.backward_share, buckets)
    collectives = buckets
    if layout.kind == "tp_dp":
        assert w.shape is not None  # estimate() checked
        # Megatron: two all-reduces of the layer's output per layer forward, two backward, two more
        # when the forward is recomputed; on the critical path, never overlapped.
        count = w.shape.layers * (6 if w.activation_checkpointing else 4) * accum
        tp_traffic = all_reduce(micro * w.seq_len * w.shape.hidden * w.activation_dtype_bytes, split).times(count)
        tp_s = tp_traffic.seconds(hw)
        traffic, collectives = traffic + tp_traffic, collectives + count
        comm_s, exposed = comm_s + tp_s, exposed + tp_s
    return traffic, collectives, comm_s, exposed


def _sharded(w: Workload, hw: Hardware, split: Group, replicas: Group, accum: int, compute_s: float) -> Comm:
    """fsdp and hsdp: in every micro-step each unit's weights are gathered before its forward, and each
    block's again before its backward (the root, FSDP2's outermost unit, stays gathered from its
    forward through its backward); each unit's gradients are reduce-scattered once (and all-reduced
    across hsdp replicas)."""
    units = float(w.units)
    blocks = units - 1 if w.root_params else units
    p, b = w.params, w.bytes
    forward = _with_steps(all_gather(p * b.weights, split), units)
    backward = _with_steps(all_gather((p - w.root_params) * b.weights, split), blocks)
    sync = _with_steps(reduce_scatter(p * b.grads, split), units)
    if replicas.size > 1:  # hsdp: replicas all-reduce their shard once the shard group reduced it
        sync = sync + _with_steps(all_reduce(p * b.grads / split.size, replicas), units)
    forward_s, backward_gather_s, sync_s = forward.seconds(hw), backward.seconds(hw), sync.seconds(hw)
    micro_s = compute_s / accum
    backward_s = micro_s * w.backward_share
    # Forward gathers overlap the forward; backward gathers and the sync overlap the backward.
    exposed = (accum * _exposed(forward_s, micro_s - backward_s, units)
               + (accum - 1) * _exposed(backward_gather_s, backward_s, blocks)
               + _exposed(backward_gather_s + sync_s, backward_s, units))
    collectives = accum * (units + blocks) + units * (2 if replicas.size > 1 else 1)
    traffic = forward.times(accum) + backward.times(accum) + sync
    return traffic, collectives, accum * (forward_s + backward_gather_s) + sync_s, exposed


def _gradient_wire_bytes(w: Workload, layout: Layout, params: float) -> float | None:
    """Bytes of gradients one all-reduce round moves (before the ring's 2(n-1)/n)."""
    grads = w.bytes.replicated_grads
    if layout.compression in ("bf16", "fp16"):
        return params * min(grads, 2.0)
    if layout.compression == "powersgd":
        if w.shape is None:
            return None
        # Rank-r factors P (m x r) and Q (n x r) of each weight matrix instead of the m x n matrix:
        # four h x h and two h x 4h per layer, and the embedding; vectors go uncompressed.
        r, h, s = layout.powersgd_rank, w.shape.hidden, w.shape
        elements = s.layers * (r * (4 * 2 * h + 2 * 5 * h) + 13 * h) + r * (s.vocab + h)
        return min(elements, params) * grads
    return params * grads


def describe_memory(row: Row) -> str:
    """'needs 135.0 GB per GPU (model state 120.0 GB, buffers 15.0 GB, activations 0.0 GB), 72.0 GB usable'"""
    m = row.memory
    if m is None:
        return "memory not estimated"
    return (f"needs {_gb(m.total)} per GPU (model state {_gb(m.model_state)}, buffers {_gb(m.buffers)}, "
            f"activations {_gb(m.activations)}), {_gb(row.usable_memory)} usable")
