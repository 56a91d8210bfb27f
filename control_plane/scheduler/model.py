"""The scheduling policy's data: what a pass reads (jobs, nodes, tenants, options) and decides.

Plain values, no database: ``allocate.py`` builds them from rows and applies a ``Decision``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

INF = float("inf")
Mode = Literal["fair", "fifo", "greedy"]
MODES: tuple[Mode, ...] = ("fair", "fifo", "greedy")
PlacementRule = Literal["scored", "first-fit"]
PLACEMENT_RULES: tuple[PlacementRule, ...] = ("scored", "first-fit")

# Why a job still waits after a pass (Decision.waiting).
WAIT_QUOTA = "quota"
"""Admitting it would take its tenant above the tenant's GPU quota."""
WAIT_RESERVED = "reserved"
"""It does not fit now; it holds a reservation."""
WAIT_CAPACITY = "capacity"
"""It does not fit now (and holds no reservation: the reservations are all taken)."""
WAIT_NEVER = "never-fits"
"""The schedulable nodes it may use cannot hold it even when empty."""
WAIT_BEHIND = "behind-head"
"""fifo mode only: an earlier job is blocked."""


@dataclass(frozen=True, slots=True)
class Running:
    """GPUs of a node that a running attempt holds, and when they are released at the latest."""

    gpus: int
    ends_at: datetime | None = None
    """Start + time limit; None when the job has no time limit (it counts as running forever)."""


@dataclass(frozen=True, kw_only=True)
class NodeCapacity:
    """A schedulable node: the GPU indices free on it now and what holds the others."""

    node_id: str
    name: str
    free: tuple[int, ...]
    total: int
    gpu_kind: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    running: tuple[Running, ...] = ()


@dataclass(kw_only=True, slots=True)
class JobDemand:
    """A job waiting for a gang: ``num_nodes`` nodes with ``gpus_per_node`` free GPUs each.

    Treat as immutable (not frozen only because a pass builds ~10^4 of them, and frozen
    dataclasses are several times slower to build)."""

    job_id: str
    num_nodes: int
    gpus_per_node: int
    priority: int = 0
    submitted_at: datetime
    recovering: bool = False
    gpu_kinds: frozenset[str] | None = None
    """The GPU kinds it accepts (None: any); a gang runs on one kind."""
    avoid_nodes: frozenset[str] = frozenset()
    """Nodes this job must not use (each failed it twice)."""
    prefer_nodes: frozenset[str] = frozenset()
    """Nodes to use first: a recovering job's healthy nodes of its last attempt, so that recovery
    replaces only what failed. Held for it (strictly) while it cannot be placed."""
    tenant: str = "default"
    time_limit_s: int | None = None
    """The attempt is stopped after this long; only jobs with a limit can backfill."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("a job needs at least one node and one GPU per node")

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class TenantShare:
    """A tenant's weight, quota and the GPUs its running attempts hold at the start of the pass."""

    weight: float = 1.0
    gpu_quota: int | None = None
    gpus_in_use: int = 0

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError("a tenant's weight must be > 0")


DEFAULT_TENANT = TenantShare()


@dataclass(frozen=True, kw_only=True)
class PolicyOptions:
    mode: Mode = "fair"
    """fair: reservations and backfill. fifo and greedy are the baselines bench/scheduler.py
    compares against: fifo stops at the first job that does not fit (head-of-line blocking),
    greedy skips it (first fit, no reservations: large jobs can starve)."""
    max_reservations: int = 4
    """Blocked jobs that hold a reservation at once on the nodes of one GPU kind (recovering jobs
    hold one regardless)."""
    topology_label: str | None = "rack"
    """Node label whose value names a topology domain; a gang is kept inside one if it can be."""
    recovery_reserve: Mapping[str, int] = field(default_factory=dict)
    """GPU kind -> nodes kept for recovering jobs only."""
    recovery_reserve_default: int = 0
    """Nodes kept for recovering jobs for every GPU kind not named in ``recovery_reserve``."""
    placement: PlacementRule = "scored"
    """scored: a job that may use several kinds goes to the kind with the most free capacity
    relative to the demand that may use it, and to the nodes where it destroys the least capacity
    the waiting shapes need. first-fit: the first kind (most free GPUs at the start of the pass)
    and the fullest nodes where it fits; the baselines of bench/scheduler.py use it."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        if self.placement not in PLACEMENT_RULES:
            raise ValueError(f"placement must be one of {PLACEMENT_RULES}")
        if self.max_reservations < 0 or self.recovery_reserve_default < 0:
            raise ValueError("max_reservations and recovery_reserve_default must be >= 0")
        if any(v < 0 for v in self.recovery_reserve.values()):
            raise ValueError("recovery reserve sizes must be >= 0")

    def reserve_nodes(self, kind: str) -> int:
        return self.recovery_reserve.get(kind, self.recovery_reserve_default)


@dataclass(frozen=True)
class Placement:
    """Every GPU of one attempt: ``nodes[i]`` is node rank i with its GPU indices."""

    job_id: str
    nodes: tuple[tuple[str, tuple[int, ...]], ...]
    gpu_kind: str = ""
    """The GPU kind of its nodes."""
    backfill: bool = False
    """It uses GPUs a reservation holds, and its time limit ends before the earliest start."""
    from_reserve: bool = False
    """It uses a recovery-reserve node."""


@dataclass(frozen=True)
class HeldNode:
    """One node of a reservation."""

    node_id: str
    gpus: int
    """The job's share of this node."""
    free_at_start: int
    """GPUs free on the node at the earliest start, given what runs and was placed (finite time
    limits only); at least ``gpus`` unless the start is unknown."""
    held: int
    """GPUs free now that no job may use except as backfill (strict: not even that): idle cost."""
    strict: bool = False
    """A recovering job's healthy node: its share is held even against backfill."""


@dataclass(frozen=True)
class Reservation:
    job_id: str
    earliest_start: datetime | None
    """When the job fits on these nodes at the latest, if running jobs end by their time limits;
    None: unknown (some job it waits for has no time limit)."""
    nodes: tuple[HeldNode, ...]

    @property
    def held_gpus(self) -> int:
        return sum(n.held for n in self.nodes)

    @property
    def node_ids(self) -> tuple[str, ...]:
        return tuple(n.node_id for n in self.nodes)


@dataclass(frozen=True)
class ReserveHold:
    """The recovery reserve of one GPU kind after the pass."""

    gpu_kind: str
    node_ids: tuple[str, ...]
    idle_gpus: int


@dataclass
class Decision:
    placements: list[Placement] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)
    recovery_reserve: list[ReserveHold] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    """Job id -> why it still waits (WAIT_*)."""
