"""GPU kinds and links: the documented defaults (docs/planner.md, "Defaults") and how node labels
override them. Pure: standard library only.

Bandwidths named by people (catalog, labels, request overrides) are nominal figures; the link
kind's efficiency turns them into what collectives achieve (NCCL's bus bandwidth is typically
75-85% of NVLink's nominal rate, less over TCP). A request that passes measured figures sets the
efficiency to 1.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

GIB: Final = 2**30
GB: Final = 1e9


@dataclass(frozen=True, kw_only=True)
class LinkKind:
    """Defaults of one kind of link."""

    name: str
    efficiency: float
    """Achieved / nominal bandwidth for large collectives."""
    latency_s: float
    """Per ring step: what one hop of a collective costs however small the message."""
    nominal_gbytes_per_s: float = 0.0
    """Intra-node links: per GPU, each way. Inter-node links take their bandwidth from the GPU kind
    or a label (the node's NICs), so theirs is 0."""


INTRA_LINKS: Final[dict[str, LinkKind]] = {
    "nvlink3": LinkKind(name="nvlink3", nominal_gbytes_per_s=300, efficiency=0.8, latency_s=3e-6),
    "nvlink4": LinkKind(name="nvlink4", nominal_gbytes_per_s=450, efficiency=0.8, latency_s=3e-6),
    "nvlink5": LinkKind(name="nvlink5", nominal_gbytes_per_s=900, efficiency=0.8, latency_s=3e-6),
    "pcie4": LinkKind(name="pcie4", nominal_gbytes_per_s=32, efficiency=0.7, latency_s=5e-6),
    "pcie5": LinkKind(name="pcie5", nominal_gbytes_per_s=64, efficiency=0.7, latency_s=5e-6),
    # The development cluster's virtual slots: gloo over loopback TCP between processes.
    "loopback": LinkKind(name="loopback", nominal_gbytes_per_s=2, efficiency=1.0, latency_s=50e-6),
}
"""Links between the GPUs of one node."""

INTER_LINKS: Final[dict[str, LinkKind]] = {
    "infiniband": LinkKind(name="infiniband", efficiency=0.8, latency_s=8e-6),
    "roce": LinkKind(name="roce", efficiency=0.75, latency_s=10e-6),
    "ethernet": LinkKind(name="ethernet", efficiency=0.6, latency_s=30e-6),
    "loopback": LinkKind(name="loopback", efficiency=1.0, latency_s=50e-6),
}
"""Links between nodes (NCCL over RDMA for InfiniBand and RoCE, over TCP sockets for Ethernet)."""


@dataclass(frozen=True, kw_only=True)
class GpuKind:
    """A GPU model as typically deployed (HGX/DGX boards for SXM parts, one NIC per GPU)."""

    name: str
    memory_gib: float
    peak_tflops: float
    """Dense 16-bit tensor-core peak (bf16/fp16, no sparsity)."""
    intra_link: str
    inter_link: str
    inter_gbits_per_s: float
    """The node's NICs together, nominal."""
    patterns: tuple[str, ...] = field(default=())
    """Regular expressions matched against the lower-cased kind a node reports (NVML's name)."""


GPU_KINDS: Final[tuple[GpuKind, ...]] = (
    # More specific patterns first: "h100 pcie" before "h100".
    GpuKind(name="h100-pcie", memory_gib=80, peak_tflops=756, intra_link="pcie5", inter_link="ethernet",
            inter_gbits_per_s=400, patterns=(r"h100.*pcie",)),
    GpuKind(name="h100-nvl", memory_gib=94, peak_tflops=835, intra_link="pcie5", inter_link="ethernet",
            inter_gbits_per_s=400, patterns=(r"h100.*nvl",)),
    GpuKind(name="h100-sxm", memory_gib=80, peak_tflops=989, intra_link="nvlink4", inter_link="infiniband",
            inter_gbits_per_s=3200, patterns=(r"h100",)),
    GpuKind(name="h200", memory_gib=141, peak_tflops=989, intra_link="nvlink4", inter_link="infiniband",
            inter_gbits_per_s=3200, patterns=(r"h200",)),
    GpuKind(name="b200", memory_gib=180, peak_tflops=2250, intra_link="nvlink5", inter_link="infiniband",
            inter_gbits_per_s=3200, patterns=(r"b200",)),
    GpuKind(name="a100-pcie", memory_gib=80, peak_tflops=312, intra_link="pcie4", inter_link="ethernet",
            inter_gbits_per_s=200, patterns=(r"a100.*pcie",)),
    GpuKind(name="a100-sxm", memory_gib=80, peak_tflops=312, intra_link="nvlink3", inter_link="infiniband",
            inter_gbits_per_s=1600, patterns=(r"a100",)),
    GpuKind(name="l40s", memory_gib=48, peak_tflops=362, intra_link="pcie4", inter_link="ethernet",
            inter_gbits_per_s=200, patterns=(r"l40s",)),
    GpuKind(name="l4", memory_gib=24, peak_tflops=121, intra_link="pcie4", inter_link="ethernet",
            inter_gbits_per_s=100, patterns=(r"\bl4\b",)),
    # Stand-in for the development cluster's CPU slots (--virtual-gpus): a few GiB of host memory
    # and a CPU core's worth of FLOP/s. bench/ measures the real figures of a machine.
    GpuKind(name="virtual-cpu", memory_gib=4, peak_tflops=0.05, intra_link="loopback", inter_link="loopback",
            inter_gbits_per_s=16, patterns=(r"virtual",)),
)
"""Documented defaults per GPU kind (docs/planner.md)."""

_BY_NAME: Final = {k.name: k for k in GPU_KINDS}
_ALIASES: Final = {"h100": "h100-sxm", "a100": "a100-sxm"}


def find_gpu_kind(kind: str) -> GpuKind | None:
    """The catalog entry for a kind as a user names it (``h100``) or a node reports it
    (``NVIDIA H100 80GB HBM3``); None when the catalog does not know it."""
    key = kind.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _BY_NAME:
        return _BY_NAME[key]
    for entry in GPU_KINDS:
        if any(re.search(p, key) for p in entry.patterns):
            return entry
    return None


# -- Node labels (the agent's --label, or PUT /v1/nodes/{id}/labels) --------------------------------

LABEL_INTRA_LINK: Final = "trainyard.dev/intra-link"
"""One of INTRA_LINKS: the link between the node's GPUs."""
LABEL_INTRA_GBYTES: Final = "trainyard.dev/intra-gbytes-per-s"
"""Nominal bandwidth between two GPUs of the node, per GPU and direction, GB/s."""
LABEL_INTRA_LATENCY: Final = "trainyard.dev/intra-latency-us"
LABEL_INTER_LINK: Final = "trainyard.dev/inter-link"
"""One of INTER_LINKS: the node's network fabric."""
LABEL_INTER_GBITS: Final = "trainyard.dev/inter-gbits-per-s"
"""Nominal bandwidth of all the node's NICs together, Gbit/s (8 x 400G: 3200)."""
LABEL_INTER_LATENCY: Final = "trainyard.dev/inter-latency-us"
LABEL_GPU_MEMORY: Final = "trainyard.dev/gpu-memory-gib"
LABEL_GPU_TFLOPS: Final = "trainyard.dev/gpu-tflops"
"""Dense 16-bit peak TFLOP/s of one GPU."""

NUMERIC_LABELS: Final = (LABEL_INTRA_GBYTES, LABEL_INTRA_LATENCY, LABEL_INTER_GBITS, LABEL_INTER_LATENCY,
                         LABEL_GPU_MEMORY, LABEL_GPU_TFLOPS)
LINK_LABELS: Final = {LABEL_INTRA_LINK: INTRA_LINKS, LABEL_INTER_LINK: INTER_LINKS}
LABEL_LIMIT: Final = 1e7
"""Numeric labels above this (in their unit) are taken for typos and ignored."""


@dataclass(frozen=True)
class LabelReading:
    """What the labels of a set of nodes say, one value per label, with notes on what was ignored."""

    numbers: dict[str, float]
    links: dict[str, str]
    notes: list[str]


def read_labels(nodes: Iterable[tuple[str, Mapping[str, str]]]) -> LabelReading:
    """Conservative reading of the planner's labels over nodes (name, effective labels): a numeric
    label's smallest value (a bandwidth: the slowest node sets the pace of a collective; a latency:
    the smallest is optimistic, so the largest), a link label's most common value. Unusable values
    are ignored with a note, never an error: labels come from agents and operators."""
    numbers: dict[str, list[float]] = {}
    links: dict[str, Counter[str]] = {}
    notes: list[str] = []
    for name, labels in nodes:
        for key, raw in labels.items():
            if key in NUMERIC_LABELS:
                try:
                    value = float(raw)
                except ValueError:
                    value = float("nan")
                if not 0 < value <= LABEL_LIMIT:  # NaN fails too
                    notes.append(f"node {name}: label {key}={raw!r} is not a positive number; ignored")
                    continue
                numbers.setdefault(key, []).append(value)
            elif key in LINK_LABELS:
                value_s = raw.strip().lower()
                if value_s not in LINK_LABELS[key]:
                    notes.append(f"node {name}: label {key}={raw!r} is not one of "
                                 f"{', '.join(LINK_LABELS[key])}; ignored")
                    continue
                links.setdefault(key, Counter())[value_s] += 1
    return LabelReading(
        numbers={key: max(found) if key.endswith("latency-us") else min(found) for key, found in numbers.items()},
        links={key: sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0][0] for key, counts in links.items()},
        notes=notes,
    )
