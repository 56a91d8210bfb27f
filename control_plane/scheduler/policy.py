"""Pure scheduling policy: given the queue and free capacity, decide whole-gang placements.

No database, no clock, no I/O: ``decide`` is a function of its inputs, so its invariants
(never more GPUs than free, never a partial gang, one decision per job) are property-tested.
The transaction that applies decisions lives in ``allocate.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, kw_only=True)
class NodeCapacity:
    """A schedulable node and the GPU indices free on it now."""

    node_id: str
    name: str
    free: tuple[int, ...]
    total: int
    gpu_kind: str = ""
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class JobDemand:
    """A job waiting for a gang: ``num_nodes`` nodes with ``gpus_per_node`` free GPUs each."""

    job_id: str
    num_nodes: int
    gpus_per_node: int
    priority: int = 0
    submitted_at: datetime
    recovering: bool = False
    gpu_kind: str | None = None
    avoid_nodes: frozenset[str] = frozenset()
    """Nodes this job must not use (each failed it twice)."""
    prefer_nodes: frozenset[str] = frozenset()
    """Nodes to use first: a recovering job's healthy nodes of its last attempt, so that recovery
    replaces only what failed."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("a job needs at least one node and one GPU per node")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True)
class Placement:
    """Every GPU of one attempt: ``nodes[i]`` is node rank i with its GPU indices."""

    job_id: str
    nodes: tuple[tuple[str, tuple[int, ...]], ...]


def queue_order(jobs: Iterable[JobDemand]) -> list[JobDemand]:
    """Recovering jobs first (they already held a place), then priority, then submit time."""
    return sorted(jobs, key=lambda j: (not j.recovering, -j.priority, j.submitted_at, j.job_id))


def place(job: JobDemand, nodes: Sequence[NodeCapacity]) -> Placement | None:
    """Best fit: the job's nodes are those with the fewest free GPUs that still hold its share.

    Filling partly used nodes first keeps whole nodes free for multi-node gangs. Preferred nodes
    (a recovering job's healthy nodes) come before any other.
    """
    fits = [
        n
        for n in nodes
        if len(n.free) >= job.gpus_per_node
        and n.node_id not in job.avoid_nodes
        and (job.gpu_kind is None or n.gpu_kind == job.gpu_kind)
    ]
    if len(fits) < job.num_nodes:
        return None
    chosen = sorted(fits, key=lambda n: (n.node_id not in job.prefer_nodes, len(n.free), n.name))[: job.num_nodes]
    # Node rank 0 hosts the rendezvous; order the rest by name for stable rank placement.
    chosen.sort(key=lambda n: n.name)
    return Placement(
        job_id=job.job_id,
        nodes=tuple((n.node_id, tuple(sorted(n.free)[: job.gpus_per_node])) for n in chosen),
    )


def _take(nodes: list[NodeCapacity], placement: Placement) -> list[NodeCapacity]:
    used = {node_id: set(ix) for node_id, ix in placement.nodes}
    out = []
    for n in nodes:
        if n.node_id in used:
            n = NodeCapacity(
                node_id=n.node_id, name=n.name, total=n.total, gpu_kind=n.gpu_kind, labels=n.labels,
                free=tuple(i for i in n.free if i not in used[n.node_id]),
            )
        out.append(n)
    return out


def decide(jobs: Iterable[JobDemand], nodes: Sequence[NodeCapacity]) -> list[Placement]:
    """Place jobs in queue order; stop at the first that cannot fit (no job jumps the head).

    Strict order keeps a large job from being starved by a stream of small ones; reservations
    with backfill (which let small jobs run without delaying the head) come in a later stage.
    """
    free = list(nodes)
    decisions: list[Placement] = []
    for job in queue_order(jobs):
        p = place(job, free)
        if p is None:
            break
        decisions.append(p)
        free = _take(free, p)
    return decisions
