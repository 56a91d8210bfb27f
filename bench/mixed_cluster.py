"""The mixed-cluster scenario of bench/scheduler.py (issue 15): what a real cluster looks like.

- 1,200 nodes of 1, 2, 4 and 8 GPUs (4,861 GPUs), six GPU kinds in very skewed numbers: 2,720
  h100 down to 24 p100 (1-GPU nodes) and 24 g2 (three 8-GPU nodes).
- Jobs of 1 to 32 GPUs (16 and 32 as whole 8-GPU nodes); about a third constrained: 28.5% of all
  jobs to one kind, 5.5% to two or three (only kinds that could ever hold them).
- Heavy-tailed run times: most a few minutes (log-normal, median 2 min), 9.5% around 20 min,
  0.5% from a day to three months; 85% have a time limit 1.1-3x their run time.
- Bursts: 15,000 jobs in the first minute and 10,000 at 50 min (so over ten thousand queue), and
  a steady stream, sized so that the offered load over the arrival window is 1.15 (each job's
  GPU-seconds counted up to the end of the window).

``KindLedger`` follows, from the placements the real passes return, every node's free GPUs, the
nodes active reservations hold, and which GPUs are held by flexible jobs (any kind, or several)
that could have run on another kind they accept when they started (after their pass, that kind's
nodes no reservation holds could still hold them). Each pass it counts the job-seconds that a job
constrained to some kinds waits while (a) idle GPUs of one of its kinds, on nodes no reservation
holds, could hold it; (b) they could, counting the idle GPUs of reserved nodes too (the
reservations' cost); (c) they could, counting the GPUs of such movable flexible jobs too.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

KINDS: dict[str, tuple[tuple[int, int], ...]] = {  # kind -> (GPUs per node, nodes) at full scale
    "h100": ((8, 300), (4, 80)),
    "a100": ((8, 80), (4, 120), (2, 100)),
    "l4": ((4, 40), (2, 100), (1, 160)),
    "t4": ((2, 60), (1, 133)),
    "p100": ((1, 24),),
    "g2": ((8, 3),),
}
CONSTRAINED = {"h100": 0.40, "a100": 0.28, "l4": 0.16, "t4": 0.12, "p100": 0.02, "g2": 0.02}
"""How often a constrained job names each kind (among those that could hold it)."""
SCARCE = ("p100", "g2")
SIZES = (1, 2, 4, 8, 16, 32)
SIZE_WEIGHTS = (0.55, 0.18, 0.12, 0.10, 0.03, 0.02)
SIZE_CLASSES = (("1", 1, 1), ("2", 2, 2), ("4", 4, 4), ("8", 8, 8), ("16-32", 16, 32))
CONSTRAINT_CLASSES = ("any kind", "one kind", "several kinds", "a scarce kind only")
TENANTS = (("research", 0.4), ("vision", 0.3), ("nlp", 0.2), ("prod", 0.1))
RACK_SIZE = 32


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int
    kind: str
    rack: str


def layout(scale: float) -> list[NodeSpec]:
    out = []
    for kind, groups in KINDS.items():
        i = 0
        for gpus, count in groups:
            for _ in range(max(1, round(count * scale))):
                out.append(NodeSpec(f"{kind}-{i:04d}", gpus, kind, f"{kind}-r{i // RACK_SIZE:02d}"))
                i += 1
    return out


def shape(gpus: int) -> tuple[int, int]:
    """(nodes, GPUs per node): whole 8-GPU nodes past 8 GPUs."""
    return (1, gpus) if gpus <= 8 else (gpus // 8, 8)


def fits_ever(nodes: list[NodeSpec], kind: str, gpus: int) -> bool:
    k, g = shape(gpus)
    return sum(1 for n in nodes if n.kind == kind and n.gpus >= g) >= k


def constraint_class(kinds: tuple[str, ...] | None) -> str:
    if kinds is None:
        return "any kind"
    if set(kinds) <= set(SCARCE):
        return "a scarce kind only"
    return "one kind" if len(kinds) == 1 else "several kinds"


@dataclass(frozen=True)
class MixedJob:
    gpus: int
    runtime_s: int
    time_limit_s: int | None
    kinds: tuple[str, ...] | None
    tenant: str
    priority: int
    arrival_s: float


def _runtime(rnd: random.Random) -> int:
    u = rnd.random()
    if u < 0.005:  # a day to three months
        return int(math.exp(rnd.uniform(math.log(86400), math.log(90 * 86400))))
    if u < 0.10:
        return int(max(60.0, rnd.lognormvariate(math.log(1200), 0.8)))
    return int(max(30.0, rnd.lognormvariate(math.log(120), 1.0)))


def _job(rnd: random.Random, nodes: list[NodeSpec], arrival: float) -> MixedJob:
    gpus = rnd.choices(SIZES, SIZE_WEIGHTS)[0]
    feasible = [k for k in CONSTRAINED if fits_ever(nodes, k, gpus)]
    weights = [CONSTRAINED[k] for k in feasible]
    u = rnd.random()
    kinds: tuple[str, ...] | None = None
    if u < 0.285:
        kinds = (rnd.choices(feasible, weights)[0],)
    elif u < 0.34 and len(feasible) > 1:
        picked: list[str] = []
        for _ in range(min(len(feasible), rnd.choice((2, 2, 3)))):
            left = [k for k in feasible if k not in picked]
            picked.append(rnd.choices(left, [CONSTRAINED[k] for k in left])[0])
        kinds = tuple(picked)
    runtime = _runtime(rnd)
    limit = None if rnd.random() < 0.15 else min(365 * 86400, int(math.ceil(runtime * rnd.uniform(1.1, 3.0) / 60) * 60))
    tenant = rnd.choices([t for t, _ in TENANTS], [w for _, w in TENANTS])[0]
    return MixedJob(gpus, runtime, limit, kinds, tenant, 1 if rnd.random() < 0.02 else 0, arrival)


def jobs(nodes: list[NodeSpec], *, window_s: float, bursts: Iterable[tuple[float, int]], load: float,
         seed: int) -> list[MixedJob]:
    """Bursts (start, jobs: arriving over a minute), then a steady stream until the offered load over
    the window (GPU-seconds up to its end / the cluster's GPU-seconds) reaches ``load``."""
    rnd = random.Random(seed)
    capacity = sum(n.gpus for n in nodes) * window_s
    out = [_job(rnd, nodes, start + rnd.uniform(0, 60)) for start, count in bursts for _ in range(count)]

    def work(j: MixedJob) -> float:
        return j.gpus * min(j.runtime_s, max(0.0, window_s - j.arrival_s))

    offered = sum(work(j) for j in out)
    while offered < load * capacity:
        j = _job(rnd, nodes, rnd.uniform(0, window_s))
        out.append(j)
        offered += work(j)
    return sorted(out, key=lambda j: j.arrival_s)


def offered_load(nodes: list[NodeSpec], specs: Iterable[MixedJob], window_s: float) -> float:
    return sum(j.gpus * min(j.runtime_s, max(0.0, window_s - j.arrival_s)) for j in specs) / (
        sum(n.gpus for n in nodes) * window_s)


@dataclass
class _Node:
    kind: str
    total: int
    free: int
    movable: int = 0
    """GPUs held by flexible jobs that could have run on another kind when they started."""
    reserved: bool = False
    """An active reservation holds it."""


@dataclass
class KindLedger:
    """Free GPUs per node, from the placements and ends the bench sees (see the module docstring)."""

    nodes: dict[str, _Node] = field(default_factory=dict)
    held: dict[int, tuple[list[tuple[str, int]], bool]] = field(default_factory=dict)
    idle_job_s: float = 0.0
    """Job-seconds a constrained job waited while unreserved idle GPUs of a kind it accepts fit it."""
    reserved_job_s: float = 0.0
    """... while it would have fit on idle GPUs only counting those of reserved nodes."""
    movable_job_s: float = 0.0
    """... while it would have fit only counting the GPUs of movable flexible jobs."""
    by_kind: dict[str, list[_Node]] = field(default_factory=dict)

    def add_node(self, node_id: str, kind: str, total: int) -> None:
        self.nodes[node_id] = _Node(kind, total, total)
        self.by_kind.setdefault(kind, []).append(self.nodes[node_id])

    def reserved(self, node_ids: Iterable[str]) -> None:
        """The nodes that active reservations hold after a pass."""
        held = set(node_ids)
        for node_id, n in self.nodes.items():
            n.reserved = node_id in held

    def _fits(self, kind: str, k: int, g: int, *, reserved: bool = False, movable: bool = False) -> bool:
        return sum(1 for n in self.by_kind.get(kind, ())
                   if (reserved or not n.reserved or movable) and n.free + (n.movable if movable else 0) >= g) >= k

    def placed(self, placements: list[tuple[int, MixedJob, str, list[tuple[str, int]]]]) -> None:
        """A pass's placements: (job index, job, kind, [(node id, GPUs)]). A flexible job is movable
        if, once the whole pass is placed, another kind it accepts could still hold it on nodes no
        reservation holds (call ``reserved`` first)."""
        for _, _, _, parts in placements:
            for node_id, n in parts:
                self.nodes[node_id].free -= n
        for index, job, kind, parts in placements:
            accepted = job.kinds if job.kinds is not None else tuple(self.by_kind)
            k, g = shape(job.gpus)
            movable = len(accepted) > 1 and any(self._fits(other, k, g) for other in accepted if other != kind)
            if movable:
                for node_id, n in parts:
                    self.nodes[node_id].movable += n
            self.held[index] = (parts, movable)

    def ended(self, index: int) -> None:
        parts, movable = self.held.pop(index)
        for node_id, n in parts:
            self.nodes[node_id].free += n
            if movable:
                self.nodes[node_id].movable -= n

    def account(self, waiting: Iterable[MixedJob], seconds: float) -> None:
        shapes = Counter((j.gpus, j.kinds) for j in waiting if j.kinds is not None)
        for (gpus, kinds), count in shapes.items():
            k, g = shape(gpus)
            if any(self._fits(kind, k, g) for kind in kinds):
                self.idle_job_s += count * seconds
            elif any(self._fits(kind, k, g, reserved=True) for kind in kinds):
                self.reserved_job_s += count * seconds
            elif any(self._fits(kind, k, g, movable=True) for kind in kinds):
                self.movable_job_s += count * seconds
