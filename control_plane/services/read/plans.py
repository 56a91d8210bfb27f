"""Plans: read what the cluster says about its hardware (GPU kinds, memory, node labels), call the
pure planner (control_plane/planning), and render its rows. Used by POST /v1/plans and at job submit
(services/runs/jobs.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.errors import Unprocessable
from control_plane.models import Gpu, Node
from control_plane.planning import (
    Hardware,
    HardwareOverrides,
    PlanningError,
    Row,
    TransformerShape,
    Workload,
    bytes_per_param,
    default_counts,
    default_layouts,
    find_gpu_kind,
    plan,
    plan_job,
    read_labels,
    resolve_hardware,
)
from control_plane.planning.workload import BytesPerParam
from control_plane.schemas.plans import (
    HardwareIn,
    HardwareOut,
    JobModelIn,
    JobPlanOut,
    JobWarningOut,
    LinkOut,
    MemoryOut,
    ModelIn,
    ModelOut,
    PlanOut,
    PlanRequest,
    PlanRowOut,
    RecommendationOut,
    TrafficOut,
)
from trainyard.protocol.layout import Layout


def unprocessable(exc: PlanningError) -> Unprocessable:
    """The planner's refusal as problem+json 422, its numbers as extension members."""
    extra = dict(exc.numbers)
    if exc.field:
        extra["field"] = exc.field
    return Unprocessable(exc.message, **extra)


@dataclass(frozen=True)
class ClusterHardware:
    hardware: Hardware
    nodes: int
    notes: list[str]


def _same_kind(a: str, b: str) -> bool:
    if a == b:
        return True
    ka, kb = find_gpu_kind(a), find_gpu_kind(b)
    return ka is not None and kb is not None and ka.name == kb.name


def cluster_hardware(session: Session, gpu_kind: str, gpus_per_node: int, overrides: HardwareIn | None,
                     overrides_name: str = "hardware") -> ClusterHardware:
    """The hardware of ``gpu_kind``: the request's figures, then the labels of the cluster's nodes of
    that kind (read conservatively: planning/catalog.py, read_labels), then the memory those nodes
    reported, then the catalog."""
    rows = session.execute(
        select(Node.name, Node.labels, Node.label_overrides, Gpu.kind, func.min(Gpu.memory_mb))
        .join(Gpu, Gpu.node_id == Node.id)
        .where(Node.state != "removed")
        .group_by(Node.id, Gpu.kind)
    ).all()
    matching = [r for r in rows if _same_kind(r.kind, gpu_kind)]
    reading = read_labels((r.name, {**(r.labels or {}), **(r.label_overrides or {})}) for r in matching)
    reported = [r[4] for r in matching if r[4] and r[4] > 0]
    o = overrides.model_dump() if overrides else {}
    try:
        hardware = resolve_hardware(gpu_kind, gpus_per_node, overrides=HardwareOverrides(**o), labels=reading,
                                    reported_memory_mib=min(reported) if reported else None,
                                    overrides_name=overrides_name)
    except PlanningError as exc:
        raise unprocessable(exc) from exc
    return ClusterHardware(hardware=hardware, nodes=len({r.name for r in matching}), notes=reading.notes)


def workload(model: ModelIn, global_batch: int, micro_batch: int | None) -> Workload:
    shape = (TransformerShape(layers=model.layers, hidden=model.hidden, vocab=model.vocab or 0, heads=model.heads)
             if model.layers is not None and model.hidden is not None else None)
    params = model.params if model.params is not None else (shape.params if shape else 0.0)
    try:
        if model.bytes_per_param is not None:
            per_param = BytesPerParam(**model.bytes_per_param.model_dump(exclude_none=True))
        else:
            per_param = bytes_per_param(model.precision, model.optimizer)
        return Workload(
            params=params, bytes=per_param, seq_len=model.seq_len, global_batch=global_batch,
            micro_batch=micro_batch, shape=shape, activation_bytes_per_sample=model.activation_bytes_per_sample,
            activation_checkpointing=model.activation_checkpointing, flash_attention=model.flash_attention,
            activation_dtype_bytes=4 if model.precision == "fp32" else 2, mfu=model.mfu)
    except PlanningError as exc:
        raise unprocessable(exc) from exc


def make_plan(session: Session, body: PlanRequest, *, min_efficiency: float) -> PlanOut:
    found = cluster_hardware(session, body.gpu_kind, body.gpus_per_node, body.hardware)
    hw = found.hardware
    w = workload(body.model, body.model.global_batch, body.model.micro_batch)
    threshold = body.min_efficiency if body.min_efficiency is not None else min_efficiency
    try:
        result = plan(w, hw, body.layouts or default_layouts(hw.gpus_per_node),
                      body.gpu_counts or default_counts(hw.gpus_per_node), min_efficiency=threshold)
    except PlanningError as exc:
        raise unprocessable(exc) from exc
    best = result.recommendation.row
    return PlanOut(
        model=model_out(w), hardware=hardware_out(hw, found.nodes), rows=[row_out(r) for r in result.rows],
        recommendation=RecommendationOut(
            layout=best.layout if best else None, gpus=best.gpus if best else None,
            tokens_per_s=best.tokens_per_s if best else None, reason=result.recommendation.reason),
        min_efficiency=threshold, notes=found.notes)


def data_parallel(layout: Layout, gpus: int) -> int:
    """Ranks the batch is split over: every GPU, except that a tensor-parallel group is one."""
    if layout.kind == "tp_dp":
        return max(1, gpus // layout.tp_size)
    return gpus


def job_batch(model: JobModelIn, layout: Layout, gpus: int) -> tuple[int, int]:
    """(global batch, micro batch) of a job: one follows from the other, the layout's
    grad_accum_steps and the data-parallel ranks; both given, they must agree."""
    ranks = data_parallel(layout, gpus)
    per_micro = layout.grad_accum_steps * ranks
    if model.micro_batch is not None:
        implied = model.micro_batch * per_micro
        if model.global_batch is not None and model.global_batch != implied:
            raise Unprocessable(
                f"model.global_batch {model.global_batch} is not micro_batch {model.micro_batch} x "
                f"grad_accum_steps {layout.grad_accum_steps} x {ranks} data-parallel ranks ({implied})",
                field="model.global_batch", global_batch=model.global_batch, implied_global_batch=implied)
        return implied, model.micro_batch
    if model.global_batch is None:
        raise Unprocessable("the model block needs global_batch or micro_batch", field="model.micro_batch")
    if model.global_batch % per_micro:
        raise Unprocessable(
            f"model.global_batch {model.global_batch} is not a multiple of grad_accum_steps "
            f"{layout.grad_accum_steps} x {ranks} data-parallel ranks", field="model.global_batch",
            global_batch=model.global_batch, data_parallel=ranks)
    return model.global_batch, model.global_batch // per_micro


def plan_for_job(session: Session, *, model: JobModelIn, layout: Layout, gpu_kind: str, num_nodes: int,
                 gpus_per_node: int, min_efficiency: float) -> JobPlanOut:
    """The plan a job is submitted with; Unprocessable (422, with the numbers) when its layout
    cannot run or does not fit."""
    found = cluster_hardware(session, gpu_kind, gpus_per_node, model.hardware, "model.hardware")
    global_batch, micro = job_batch(model, layout, num_nodes * gpus_per_node)
    w = workload(model, global_batch, micro)
    try:
        rows, mine, warnings = plan_job(w, found.hardware, layout, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                                        min_efficiency=min_efficiency)
    except PlanningError as exc:
        raise unprocessable(exc) from exc
    return JobPlanOut(
        model=model_out(w), hardware=hardware_out(found.hardware, found.nodes), row=row_out(mine),
        rows=[row_out(r) for r in rows],
        warnings=[JobWarningOut(kind=x.kind, message=x.message, better_gpus=x.better_gpus) for x in warnings],
        min_efficiency=min_efficiency, notes=found.notes)


def job_gpu_kind(session: Session, gpu_kinds: list[str] | None, gpus_per_node: int) -> str:
    """The kind a job is planned for: the one it requires, else, among the kinds it accepts (any when
    ``gpu_kinds`` is None) of the nodes it could run on, the one with the least memory (the plan
    must hold wherever the job lands)."""
    if gpu_kinds and len(gpu_kinds) == 1:
        return gpu_kinds[0]
    rows = session.execute(
        select(Gpu.kind, func.min(Gpu.memory_mb), func.count(Gpu.id))
        .join(Node, Node.id == Gpu.node_id)
        .where(Node.state != "removed")
        .group_by(Gpu.node_id, Gpu.kind)
    ).all()
    kinds: dict[str, float] = {}
    for kind, memory_mb, count in rows:
        if count < gpus_per_node or (gpu_kinds and kind not in gpu_kinds):
            continue
        entry = find_gpu_kind(kind)
        memory = memory_mb if memory_mb else (entry.memory_gib * 1024 if entry else 0.0)
        kinds[kind] = min(kinds.get(kind, memory), memory)
    if not kinds:
        raise Unprocessable("no node can hold the job, so there is no GPU kind to plan for", field="gpus_per_node")
    return min(kinds.items(), key=lambda kv: (kv[1], kv[0]))[0]


def model_out(w: Workload) -> ModelOut:
    b = w.bytes
    return ModelOut(
        params=w.params, model_state_bytes=round(w.model_state_bytes),
        bytes_per_param={"weights": b.weights, "grads": b.grads, "optimizer": b.optimizer, "master": b.master,
                         "total": b.total},
        activation_bytes_per_sample=w.activations_per_sample(), tokens_per_step=w.tokens_per_step,
        flops_per_token=w.flops_per_token)


def hardware_out(hw: Hardware, nodes: int) -> HardwareOut:
    return HardwareOut(
        gpu_kind=hw.gpu_kind, memory_bytes=round(hw.memory_bytes), usable_memory_bytes=round(hw.usable_memory_bytes),
        peak_tflops=hw.peak_flops / 1e12, gpus_per_node=hw.gpus_per_node,
        intra_node=LinkOut(name=hw.intra.name, gbytes_per_s=hw.intra.bytes_per_s / 1e9,
                           latency_us=hw.intra.latency_s * 1e6),
        inter_node=LinkOut(name=hw.inter.name, gbytes_per_s=hw.inter.bytes_per_s / 1e9,
                           latency_us=hw.inter.latency_s * 1e6),
        sources=dict(hw.sources), cluster_nodes=nodes)


def row_out(r: Row) -> PlanRowOut:
    m, t = r.memory, r.traffic
    return PlanRowOut(
        layout=r.layout, gpus=r.gpus, nodes=r.nodes, gpus_per_node=r.gpus_per_node, data_parallel=r.data_parallel,
        micro_batch=r.micro_batch,
        memory=MemoryOut(model_state_bytes=round(m.model_state), buffers_bytes=round(m.buffers),
                         activations_bytes=round(m.activations), total_bytes=round(m.total),
                         usable_bytes=round(r.usable_memory), fits=r.fits) if m else None,
        traffic=TrafficOut(intra_node_bytes=round(t.intra_bytes), inter_node_bytes=round(t.inter_bytes),
                           collectives=round(r.collectives)) if t else None,
        compute_s=r.compute_s, comm_s=r.comm_s, exposed_comm_s=r.exposed_comm_s,
        step_s_no_overlap=r.step_s_no_overlap, step_s=r.step_s, tokens_per_s=r.tokens_per_s,
        tokens_per_s_per_gpu=r.tokens_per_s_per_gpu, scaling_efficiency=r.scaling_efficiency,
        feasible=r.feasible, problem=r.problem)
