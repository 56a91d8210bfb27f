"""A plan: every layout on every GPU count considered, scaling efficiency, a recommendation with its
reason, and the verdict on a job's own choice. Pure: standard library and the wire contract only."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from control_plane.planning.errors import PlanningError
from control_plane.planning.estimate import Row, describe_memory, estimate
from control_plane.planning.hardware import Hardware
from control_plane.planning.workload import Workload
from trainyard.protocol.layout import APPLIED_KINDS, Layout

DEFAULT_NODE_COUNTS: Final = (1, 2, 4, 8, 16, 32, 64)
"""Whole nodes a plan considers when the request names no GPU counts."""
KIND_ORDER: Final = ("ddp", "hsdp", "fsdp", "tp_dp")
"""Among equals, the simpler layout first."""


def default_layouts(gpus_per_node: int) -> list[Layout]:
    return [Layout(kind="ddp"), Layout(kind="fsdp"), Layout(kind="hsdp"),
            Layout(kind="tp_dp", tp_size=min(gpus_per_node, 64))]


def default_counts(gpus_per_node: int) -> list[int]:
    return [gpus_per_node * n for n in DEFAULT_NODE_COUNTS]


def rate(tokens_per_s: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.3g}{unit} tokens/s"
    return f"{tokens_per_s:.3g} tokens/s"


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    row: Row | None
    reason: str


@dataclass(frozen=True, kw_only=True)
class Plan:
    rows: list[Row]
    """Layouts in the order asked, each over the counts in increasing order."""
    recommendation: Recommendation


def plan(w: Workload, hw: Hardware, layouts: list[Layout], counts: list[int], *, min_efficiency: float) -> Plan:
    """Every layout on every count. Raises PlanningError, with the numbers, when nothing fits."""
    if not layouts or not counts:
        raise PlanningError("a plan needs at least one layout and one GPU count")
    if any(n < 1 for n in counts):
        raise PlanningError("GPU counts must be at least 1", field="gpu_counts")
    rows: list[Row] = []
    for layout in layouts:
        rows += with_efficiency([estimate(w, hw, layout, n) for n in sorted(set(counts))])
    sized = [r for r in rows if r.memory is not None]
    if not any(r.feasible for r in rows):
        if not sized:
            problems = sorted({r.problem for r in rows if r.problem})
            raise PlanningError("no layout can run on the GPU counts considered: " + "; ".join(problems[:4]))
        least = min(sized, key=lambda r: r.memory.total if r.memory else 0.0)
        raise PlanningError(
            f"nothing fits: the least memory any layout needs is {describe_memory(least)} "
            f"({least.layout.kind} on {least.gpus} GPUs)",
            least_memory_bytes=round(least.memory.total if least.memory else 0.0),
            usable_memory_bytes=round(least.usable_memory), layout=least.layout.kind, gpus=least.gpus)
    return Plan(rows=rows, recommendation=recommend(rows, min_efficiency))


def with_efficiency(rows: list[Row]) -> list[Row]:
    """Scaling efficiency of each row of one layout: its tokens/s per GPU against the smallest
    count at which the layout runs."""
    runnable = [r for r in rows if r.feasible]
    if not runnable:
        return rows
    first = min(runnable, key=lambda r: r.gpus)
    per_gpu = first.tokens_per_s_per_gpu or 0.0
    return [replace(r, scaling_efficiency=(r.tokens_per_s_per_gpu or 0.0) / per_gpu)
            if r.feasible and per_gpu > 0 else r for r in rows]


def _order(row: Row) -> tuple[float, int, int, float]:
    memory = row.memory.total if row.memory else 0.0
    return (-(row.tokens_per_s or 0.0), row.gpus, KIND_ORDER.index(row.layout.kind), memory)


def recommend(rows: list[Row], min_efficiency: float) -> Recommendation:
    """The most tokens/s among layouts the runtime applies whose scaling efficiency is at least
    ``min_efficiency``; among equals the fewest GPUs, then the simpler layout."""
    applied = [r for r in rows if r.feasible and r.layout.kind in APPLIED_KINDS]
    if not applied:
        planned = [r for r in rows if r.feasible]
        best = min(planned, key=_order) if planned else None
        where = f": {best.layout.kind} on {best.gpus} GPUs, {rate(best.tokens_per_s or 0)}" if best else ""
        return Recommendation(row=None, reason="no layout the runtime applies (ddp, fsdp, hsdp) fits; only a "
                              f"planned one does{where}")
    efficient = [r for r in applied if (r.scaling_efficiency or 0.0) >= min_efficiency - 1e-9]
    best = min(efficient or applied, key=_order)
    parts = [f"{best.layout.kind} on {best.gpus} GPUs ({best.nodes} node{'s' if best.nodes > 1 else ''}): "
             f"{rate(best.tokens_per_s or 0)}, {100 * (best.scaling_efficiency or 0):.0f}% scaling efficiency"]
    for other in sorted((r for r in rows if r.gpus == best.gpus and r.layout.kind != best.layout.kind),
                        key=lambda r: KIND_ORDER.index(r.layout.kind)):
        if other.problem:
            parts.append(f"{other.layout.kind}: {other.problem}")
        elif not other.fits:
            parts.append(f"{other.layout.kind} does not fit ({describe_memory(other)})")
        elif other.tokens_per_s is not None:
            parts.append(f"{other.layout.kind}: {rate(other.tokens_per_s)}")
    bigger = [r for r in rows if r.layout == best.layout and r.gpus > best.gpus and r.feasible]
    if bigger:
        nxt = min(bigger, key=lambda r: r.gpus)
        parts.append(f"{nxt.gpus} GPUs would give {rate(nxt.tokens_per_s or 0)} at "
                     f"{100 * (nxt.scaling_efficiency or 0):.0f}% efficiency"
                     + (f", below the {100 * min_efficiency:.0f}% threshold"
                        if (nxt.scaling_efficiency or 0) < min_efficiency else ""))
    if not efficient:
        parts.append(f"no layout keeps {100 * min_efficiency:.0f}% scaling efficiency; this one is the fastest")
    return Recommendation(row=best, reason="; ".join(parts))


@dataclass(frozen=True, kw_only=True)
class JobWarning:
    kind: str
    """``efficiency`` (throughput per GPU below the threshold) or ``throughput`` (fewer GPUs do more)."""
    message: str
    better_gpus: int


def check_job(rows: list[Row], gpus: int, *, min_efficiency: float) -> tuple[Row, list[JobWarning]]:
    """The job's own row among ``rows`` (one layout over several counts, with efficiencies), and
    what the job is warned about. Raises PlanningError, with the numbers, when its layout cannot run."""
    mine = next((r for r in rows if r.gpus == gpus), None)
    if mine is None:
        raise PlanningError(f"no plan row for {gpus} GPUs")
    kind = mine.layout.kind
    if mine.problem:
        raise PlanningError(f"layout {kind} cannot run on {gpus} GPUs: {mine.problem}", field="layout")
    if not mine.fits:
        memory = mine.memory
        assert memory is not None  # no problem: estimated
        raise PlanningError(
            f"layout {kind} does not fit in GPU memory on {gpus} GPUs: it {describe_memory(mine)}",
            field="layout", gpus=gpus, needed_bytes=round(memory.total), usable_bytes=round(mine.usable_memory),
            model_state_bytes=round(memory.model_state), buffers_bytes=round(memory.buffers),
            activations_bytes=round(memory.activations))
    warnings: list[JobWarning] = []
    smaller = [r for r in rows if r.feasible and r.gpus < gpus]
    efficiency = mine.scaling_efficiency or 0.0
    if smaller and efficiency < min_efficiency:
        first = min(smaller, key=lambda r: r.gpus)
        kept = [r for r in smaller if (r.scaling_efficiency or 0.0) >= min_efficiency]
        better = max(kept, key=lambda r: r.gpus) if kept else first
        warnings.append(JobWarning(kind="efficiency", better_gpus=better.gpus, message=(
            f"on {gpus} GPUs each GPU does {100 * efficiency:.0f}% of what it does on {first.gpus} "
            f"(threshold {100 * min_efficiency:.0f}%); {better.gpus} GPUs keep "
            f"{100 * (better.scaling_efficiency or 0):.0f}% ({rate(better.tokens_per_s or 0)})")))
    faster = max(smaller, key=lambda r: r.tokens_per_s or 0.0) if smaller else None
    if faster is not None and (faster.tokens_per_s or 0.0) > (mine.tokens_per_s or 0.0):
        warnings.append(JobWarning(kind="throughput", better_gpus=faster.gpus, message=(
            f"{gpus} GPUs give {rate(mine.tokens_per_s or 0)}, less than {faster.gpus} GPUs "
            f"({rate(faster.tokens_per_s or 0)})")))
    return mine, warnings


def job_counts(num_nodes: int, gpus_per_node: int) -> list[int]:
    """The counts a job's plan compares: parts of one node and whole nodes, in powers of two, and the
    job's own count."""
    counts = {gpus_per_node * num_nodes}
    n = 1
    while n < gpus_per_node:
        counts.add(n)
        n *= 2
    n = 1
    while n < num_nodes:
        counts.add(gpus_per_node * n)
        n *= 2
    return sorted(counts)


def plan_job(w: Workload, hw: Hardware, layout: Layout, *, num_nodes: int, gpus_per_node: int,
             min_efficiency: float) -> tuple[list[Row], Row, list[JobWarning]]:
    """A job's layout over the counts it is compared with, its own row, its warnings."""
    rows = with_efficiency([estimate(w, hw, layout, n) for n in job_counts(num_nodes, gpus_per_node)])
    mine, warnings = check_job(rows, num_nodes * gpus_per_node, min_efficiency=min_efficiency)
    return rows, mine, warnings
