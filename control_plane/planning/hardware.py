"""The hardware a plan assumes, resolved from the catalog, node labels and the request's own
figures, each with its source. Pure: standard library only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, TypeVar

from control_plane.planning.catalog import (
    GIB,
    INTER_LINKS,
    INTRA_LINKS,
    LABEL_GPU_MEMORY,
    LABEL_GPU_TFLOPS,
    LABEL_INTER_GBITS,
    LABEL_INTER_LATENCY,
    LABEL_INTER_LINK,
    LABEL_INTRA_GBYTES,
    LABEL_INTRA_LATENCY,
    LABEL_INTRA_LINK,
    LabelReading,
    find_gpu_kind,
)
from control_plane.planning.errors import PlanningError

T = TypeVar("T")

DEFAULT_INTRA_LINK: Final = "pcie4"
DEFAULT_INTER_LINK: Final = "ethernet"
DEFAULT_INTER_GBITS: Final = 100.0
"""Links assumed for a GPU kind the catalog does not know (and no label names)."""
DEFAULT_MEMORY_RESERVE: Final = 0.1
"""Share of GPU memory the plan leaves to the CUDA context, NCCL buffers and allocator fragmentation."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link class as collectives see it."""

    name: str
    bytes_per_s: float
    """Achieved bandwidth per GPU and direction (inter-node: the GPU's share of the node's NICs)."""
    latency_s: float
    """Cost of one ring step."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    gpu_kind: str
    memory_bytes: float
    peak_flops: float
    """Dense 16-bit peak FLOP/s of one GPU."""
    gpus_per_node: int
    intra: Link
    inter: Link
    memory_reserve: float = DEFAULT_MEMORY_RESERVE
    sources: dict[str, str] = field(default_factory=dict)
    """Figure -> where it came from (catalog, label, reported by the node, request)."""

    def __post_init__(self) -> None:
        for name, value, (low, high) in (
            ("memory_bytes", self.memory_bytes, (1e6, 1e17)), ("peak_flops", self.peak_flops, (1e6, 1e18)),
            ("gpus_per_node", self.gpus_per_node, (1, 4096)), ("memory_reserve", self.memory_reserve, (0, 0.99)),
            ("intra bandwidth", self.intra.bytes_per_s, (1e3, 1e15)), ("intra latency", self.intra.latency_s, (0, 1)),
            ("inter bandwidth", self.inter.bytes_per_s, (1e3, 1e15)), ("inter latency", self.inter.latency_s, (0, 1)),
        ):
            if not low <= value <= high:  # NaN fails too
                raise PlanningError(f"{name} must be in [{low:g}, {high:g}], got {value:g}", field=name)

    @property
    def usable_memory_bytes(self) -> float:
        return self.memory_bytes * (1 - self.memory_reserve)


@dataclass(frozen=True, kw_only=True)
class HardwareOverrides:
    """Figures a request sets itself; they win over labels and the catalog. Bandwidths nominal
    (the link's efficiency applies) unless ``link_efficiency`` says otherwise."""

    gpu_memory_gib: float | None = None
    peak_tflops: float | None = None
    intra_link: str | None = None
    intra_gbytes_per_s: float | None = None
    intra_latency_us: float | None = None
    inter_link: str | None = None
    inter_gbits_per_s: float | None = None
    inter_latency_us: float | None = None
    link_efficiency: float | None = None
    memory_reserve: float | None = None


def _pick(sources: dict[str, str], name: str, *candidates: tuple[T | None, str]) -> T | None:
    """The first candidate value that is not None, recording its source."""
    for value, source in candidates:
        if value is not None:
            sources[name] = source
            return value
    return None


def _pick_or(sources: dict[str, str], name: str, *candidates: tuple[T | None, str], last: tuple[T, str]) -> T:
    """As _pick, with a last candidate that is always there."""
    found = _pick(sources, name, *candidates)
    if found is not None:
        return found
    sources[name] = last[1]
    return last[0]


def resolve_hardware(
    gpu_kind: str,
    gpus_per_node: int,
    *,
    overrides: HardwareOverrides | None = None,
    labels: LabelReading | None = None,
    reported_memory_mib: float | None = None,
    overrides_name: str = "hardware",
) -> Hardware:
    """Every figure from, in order: the request, the nodes' labels, what the nodes reported (memory),
    the catalog entry of the GPU kind, the defaults for unknown kinds. ``overrides_name``: where the
    request carries its figures, for the error that asks for them."""
    o = overrides or HardwareOverrides()
    numbers = labels.numbers if labels else {}
    links = labels.links if labels else {}
    entry = find_gpu_kind(gpu_kind)
    catalog = f"catalog ({entry.name})" if entry else "default for an unknown GPU kind"
    sources: dict[str, str] = {}

    memory_gib = _pick(
        sources, "memory", (o.gpu_memory_gib, "request"), (numbers.get(LABEL_GPU_MEMORY), f"label {LABEL_GPU_MEMORY}"),
        (reported_memory_mib / 1024 if reported_memory_mib else None, "reported by the nodes"),
        (entry.memory_gib if entry else None, catalog))
    tflops = _pick(sources, "peak_flops", (o.peak_tflops, "request"),
                   (numbers.get(LABEL_GPU_TFLOPS), f"label {LABEL_GPU_TFLOPS}"),
                   (entry.peak_tflops if entry else None, catalog))
    if memory_gib is None or tflops is None:
        missing = [n for n, v in (("gpu_memory_gib", memory_gib), ("peak_tflops", tflops)) if v is None]
        raise PlanningError(
            f"GPU kind {gpu_kind!r} is not in the planner's catalog: give "
            f"{' and '.join(f'{overrides_name}.{m}' for m in missing)} "
            f"(or the node labels {LABEL_GPU_MEMORY} and {LABEL_GPU_TFLOPS})", field="gpu_kind")

    intra_name = _pick_or(sources, "intra_link", (o.intra_link, "request"),
                          (links.get(LABEL_INTRA_LINK), f"label {LABEL_INTRA_LINK}"),
                          (entry.intra_link if entry else None, catalog), last=(DEFAULT_INTRA_LINK, catalog))
    inter_name = _pick_or(sources, "inter_link", (o.inter_link, "request"),
                          (links.get(LABEL_INTER_LINK), f"label {LABEL_INTER_LINK}"),
                          (entry.inter_link if entry else None, catalog), last=(DEFAULT_INTER_LINK, catalog))
    if intra_name not in INTRA_LINKS:
        raise PlanningError(f"intra_link {intra_name!r} is not one of {', '.join(INTRA_LINKS)}", field="intra_link")
    if inter_name not in INTER_LINKS:
        raise PlanningError(f"inter_link {inter_name!r} is not one of {', '.join(INTER_LINKS)}", field="inter_link")
    intra_kind, inter_kind = INTRA_LINKS[intra_name], INTER_LINKS[inter_name]

    intra_gbytes = _pick_or(sources, "intra_bandwidth", (o.intra_gbytes_per_s, "request"),
                            (numbers.get(LABEL_INTRA_GBYTES), f"label {LABEL_INTRA_GBYTES}"),
                            last=(intra_kind.nominal_gbytes_per_s, f"link {intra_name}"))
    inter_gbits = _pick_or(sources, "inter_bandwidth", (o.inter_gbits_per_s, "request"),
                           (numbers.get(LABEL_INTER_GBITS), f"label {LABEL_INTER_GBITS}"),
                           (entry.inter_gbits_per_s if entry else None, catalog), last=(DEFAULT_INTER_GBITS, catalog))
    intra_us = _pick_or(sources, "intra_latency", (o.intra_latency_us, "request"),
                        (numbers.get(LABEL_INTRA_LATENCY), f"label {LABEL_INTRA_LATENCY}"),
                        last=(intra_kind.latency_s * 1e6, f"link {intra_name}"))
    inter_us = _pick_or(sources, "inter_latency", (o.inter_latency_us, "request"),
                        (numbers.get(LABEL_INTER_LATENCY), f"label {LABEL_INTER_LATENCY}"),
                        last=(inter_kind.latency_s * 1e6, f"link {inter_name}"))
    if o.link_efficiency is not None:
        sources["link_efficiency"] = "request"
    intra_eff = o.link_efficiency if o.link_efficiency is not None else intra_kind.efficiency
    inter_eff = o.link_efficiency if o.link_efficiency is not None else inter_kind.efficiency
    reserve = o.memory_reserve if o.memory_reserve is not None else DEFAULT_MEMORY_RESERVE
    return Hardware(
        gpu_kind=entry.name if entry else gpu_kind,
        memory_bytes=memory_gib * GIB,
        peak_flops=tflops * 1e12,
        gpus_per_node=gpus_per_node,
        intra=Link(name=intra_name, bytes_per_s=intra_gbytes * 1e9 * intra_eff,
                   latency_s=intra_us * 1e-6),
        # Every GPU of a node runs its own part of each collective at once: each gets its share of the NICs.
        inter=Link(name=inter_name,
                   bytes_per_s=inter_gbits * 1e9 / 8 * inter_eff / gpus_per_node,
                   latency_s=inter_us * 1e-6),
        memory_reserve=reserve,
        sources=sources,
    )
