"""What a pass knows about the nodes: free GPUs, what runs, the holds on them, and how much the
waiting demand values each node's free GPUs (``engine.py`` runs the pass over these).

Nodes of a GPU kind form a ``KindPool``, indexed by how many GPUs an ordinary job may take on them
(``KindPool.buckets``), so "does a gang of k x g fit" is a sum over at most max-GPUs-per-node
buckets and placing scans only nodes that can hold a share. Within a bucket nodes are in their
canonical ``rank``: an order computed from capacities and what runs (never from names or input
order), so that the decision is a function of capacities and demand (docs/architecture.md,
"Placement"). Times are POSIX seconds; INF is "no time limit".
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from operator import attrgetter

from control_plane.scheduler.model import INF, JobDemand, NodeCapacity


class Hold:
    """A reservation being built or kept during a pass; ``partial``: only a recovering job's healthy
    nodes, held from the start of the pass until the job's turn completes or drops it.

    It occupies its job's share of each of its nodes from ``start`` to ``end`` (start + the job's
    time limit): later reservations are planned around that interval, so several can share a node
    (a 1-GPU reservation does not keep a 2-node gang from reserving the node's other GPUs)."""

    __slots__ = ("job", "start", "nodes", "partial", "share", "pool")

    def __init__(self, job: JobDemand, start: float, nodes: list[NodeState], pool: KindPool,
                 partial: bool = False) -> None:
        self.job = job
        self.start = start
        self.nodes = nodes
        self.partial = partial
        self.share = job.gpus_per_node
        self.pool = pool
        """The GPU kind it holds (a gang is of one kind): reservations are capped per kind."""

    @property
    def end(self) -> float:
        limit = self.job.time_limit_s
        return self.start + limit if limit and self.start < INF else INF


def hold_need(h: Hold, holds: list[Hold]) -> int:
    """GPUs the reservations ``holds`` of one node occupy at ``h``'s start (``h``'s own share included)."""
    return h.share + sum(k.share for k in holds if k is not h and k.start <= h.start < k.end)


class NodeState:
    __slots__ = ("id", "name", "kind", "label", "total", "free", "rel", "holds", "strict", "guard", "reserve",
                 "key", "rank")

    def __init__(self, cap: NodeCapacity, label_key: str | None) -> None:
        self.id = cap.node_id
        self.name = cap.name
        self.kind = cap.gpu_kind
        self.label = cap.labels.get(label_key) if label_key else None
        self.total = cap.total
        self.free = sorted(cap.free)
        # (release time, GPUs) of what runs here, including what this pass places.
        self.rel = [(r.ends_at.timestamp() if r.ends_at is not None else INF, r.gpus) for r in cap.running]
        self.holds: list[Hold] = []  # the reservations on it, in the order they were made
        self.strict = False  # a recovering job's healthy node: its only reservation is that job's
        self.guard = 0  # strict: GPUs kept from others (the largest share among its recovering jobs)
        self.reserve = False
        self.key = -1  # the bucket it is in (-1: none)
        self.rank = 0  # canonical order (set by rank_nodes)

    def general(self) -> int:
        """GPUs an ordinary job (no reservation of its own, no backfill) may take here."""
        f = len(self.free)
        if not self.holds:
            return f
        if self.strict:
            return max(0, f - self.guard)
        return max(0, min(f, min(self.room(h, self.holds) for h in self.holds)))

    def allowed(self, j: JobDemand, jend: float) -> int:
        """GPUs ``j`` (ending by ``jend``) may take here now without delaying a reservation: its
        own is ignored, one starting no earlier than ``jend`` is backfilled."""
        f = len(self.free)
        if not self.holds:
            return f
        own = [h for h in self.holds if h.job is j]
        if self.strict:
            return f if own else self.general()
        others = [h for h in self.holds if h.job is not j]
        rooms = [self.room(h, others) for h in others if not (jend < INF and jend <= h.start)]
        return max(0, min(f, *rooms)) if rooms else f

    def room(self, h: Hold, holds: list[Hold]) -> int:
        """GPUs free now that a job running past ``h``'s start may take without delaying it."""
        return self.free_by(h.start) - hold_need(h, holds)

    def fits(self, g: int, t: float, end: float, holds: list[Hold]) -> bool:
        """Whether a reservation of ``g`` GPUs from ``t`` to ``end`` fits here beside ``holds``."""
        if self.free_by(t) < g + sum(k.share for k in holds if k.start <= t < k.end):
            return False
        return all(self.free_by(k.start) >= hold_need(k, holds) + g for k in holds if t <= k.start < end)

    def times(self, now: float, holds: list[Hold]) -> list[float]:
        """When what is free here can grow: now, releases, the ends of ``holds``."""
        return sorted({now} | {e for e, _ in self.rel if now < e < INF} | {k.end for k in holds if now < k.end < INF})

    def ready_beside(self, g: int, limit: float, now: float, holds: list[Hold]) -> float:
        """The earliest start of a reservation of ``g`` GPUs for ``limit`` seconds beside ``holds``."""
        if not holds:
            return self.ready_at(g, now)
        for t in self.times(now, holds):
            if self.fits(g, t, t + limit, holds):
                return t
        return INF

    def ready_at(self, gpus: int, now: float) -> float:
        """When ``gpus`` GPUs are free here at the latest, if jobs end by their time limits."""
        missing = gpus - len(self.free)
        if missing <= 0:
            return now
        for end, n in sorted(self.rel):
            missing -= n
            if missing <= 0:
                return max(end, now)
        return INF

    def free_by(self, t: float) -> int:
        return len(self.free) + sum(n for end, n in self.rel if end <= t and end < INF)


_rank = attrgetter("rank")
CLAIM_UNIT = 2520
"""Claims count GPUs in 1/2520ths (divisible by 1..10): a job naming n kinds claims 1/n on each,
in integers, so the sums do not depend on the order jobs are counted in."""


def useful(free: int, share: int) -> int:
    """GPUs of ``free`` that jobs taking ``share`` GPUs per node can use."""
    return free - free % share if free > 0 else 0


class KindPool:
    """The nodes of one GPU kind, bucketed by ``general()``, each bucket in rank order; and what the
    waiting demand makes of this kind (``weigh``)."""

    def __init__(self, kind: str, nodes: list[NodeState]) -> None:
        self.kind = kind
        self.nodes = nodes
        self.maxcap = max(n.total for n in nodes)
        self.buckets: list[list[NodeState]] = [[] for _ in range(self.maxcap + 1)]
        self.reserve: list[NodeState] = []
        self.by_id = {n.id: n for n in nodes}
        # total_ge[g]: nodes with at least g GPUs in all (whether a gang could ever fit).
        self.total_ge = [sum(1 for n in nodes if n.total >= g) for g in range(self.maxcap + 1)]
        self.free = sum(len(n.free) for n in nodes)
        """GPUs free now (placements of this pass taken out)."""
        self.rank = 0
        self.need = 0.0
        """GPUs of waiting jobs that may run on this kind, each job's split evenly over its kinds."""
        self.held = 0
        """Reservations of queued (not recovering) jobs on this kind: capped by max_reservations."""
        self.claims: dict[int, int] = {}
        """GPUs-per-node share -> GPUs (in CLAIM_UNITs) that waiting jobs naming this kind among
        theirs want here, each split over the kinds it names; less what this pass placed."""
        # cost[g][b]: capacity the waiting shapes lose when a g-GPU share is taken on a node with b
        # GPUs free; order[g]: the buckets in the order a g-GPU share tries them.
        self.cost: list[list[float]] = [[0.0] * (self.maxcap + 1) for _ in range(self.maxcap + 1)]
        self.order: list[list[int]] = [list(range(g, self.maxcap + 1)) for g in range(self.maxcap + 1)]
        for n in nodes:
            self.reindex(n)

    def reindex(self, n: NodeState) -> None:
        k = -1 if n.reserve else n.general()
        if k != n.key:
            if n.key >= 0:
                bucket = self.buckets[n.key]
                del bucket[bisect_left(bucket, n.rank, key=_rank)]
            if k >= 0:
                insort(self.buckets[k], n, key=_rank)
            n.key = k

    def count_ge(self, g: int) -> int:
        return sum(len(b) for b in self.buckets[g:])

    def fits_ever(self, g: int, k: int) -> bool:
        return g <= self.maxcap and self.total_ge[g] >= k

    def weigh(self, need: Iterable[float], by_share: Mapping[int, list[float]], scored: bool) -> None:
        """Set ``need`` and the fragmentation costs from the demand that may use this kind: the
        GPUs waiting jobs would take, split evenly over the kinds each may use (``by_share``: per
        GPUs-per-node share). A share's cost on a node with b free GPUs is the capacity the
        waiting shapes lose, weighted by how much of the demand each shape is (in the spirit of
        fragmentation gradient descent): a small job fills a partly used node (nothing that fits
        there is lost) before it breaks a whole one (which an 8-GPU job needed)."""
        self.need = math.fsum(need)  # fsum: exact, so the same whatever the jobs' order
        weights = {s: math.fsum(v) for s, v in by_share.items() if s <= self.maxcap}
        total = math.fsum(weights.values())
        if not scored or total <= 0:
            return
        for g in range(1, self.maxcap + 1):
            row = self.cost[g]
            for b in range(g, self.maxcap + 1):
                row[b] = math.fsum(w * (useful(b, s) - useful(b - g, s)) for s, w in weights.items()) / total
            self.order[g] = sorted(range(g, self.maxcap + 1), key=lambda b: (row[b], b))  # noqa: B023

    def preference(self) -> float:
        """How much free capacity this kind has relative to the demand that may use it, in powers
        of two (kinds within a factor of two of each other are equally good): flexible jobs go to
        the kinds with the most, so a scarce kind is left to the jobs that need it."""
        if self.free <= 0:
            return -INF
        if self.need <= 0:
            return INF
        return float(math.floor(math.log2(self.free / self.need)))

    def conflict(self, chosen: Sequence[NodeState], g: int) -> int:
        """The capacity a g-GPU share on each of ``chosen`` takes from jobs that named this kind
        (their claims, at most): a job that could run elsewhere does not take a kind's GPUs from
        the jobs that wait for that kind."""
        lost = 0
        for share, claimed in self.claims.items():
            if claimed > 0:
                usable = sum(useful(len(n.free), share) - useful(len(n.free) - g, share) for n in chosen)
                lost += min(claimed, usable * CLAIM_UNIT)
        return lost

    def score(self, chosen: Sequence[NodeState], g: int) -> float:
        """The capacity a g-GPU share on each of ``chosen`` takes from the waiting shapes."""
        row = self.cost[g]
        return math.fsum(row[min(self.maxcap, max(g, len(n.free)))] for n in chosen)


def _latest_end(n: NodeState) -> float:
    return max((end for end, _ in n.rel), default=-INF)


def rank_nodes(nodes: list[NodeState], tags: Mapping[str, tuple[object, ...]]) -> None:
    """Give every node its canonical rank: the order ties are broken in. Nodes whose running work
    ends latest come first (small jobs fill nodes that will not be whole soon), then smaller nodes,
    then everything else a decision could depend on (free indices, releases, topology label, the
    jobs that prefer or avoid it, ``tags``), and the node id only between nodes identical in all."""
    def key(n: NodeState) -> tuple[object, ...]:
        return (-_latest_end(n), n.total, tuple(n.free), tuple(sorted(n.rel)), n.label or "",
                tags.get(n.id, ()), n.id)

    for i, n in enumerate(sorted(nodes, key=key)):
        n.rank = i


def rank_pools(pools: list[KindPool], tags: Callable[[str], tuple[object, ...]]) -> list[KindPool]:
    """Pools in canonical order (most free GPUs first; ``tags``: the jobs that name each kind);
    the kind's name only orders kinds identical in everything else. Nodes must be ranked first."""
    def brief(p: KindPool) -> tuple[object, ...]:
        return (-p.free, -sum(n.total for n in p.nodes), len(p.nodes))

    def full(p: KindPool) -> tuple[object, ...]:
        shape = tuple((-_latest_end(n), n.total, tuple(n.free), tuple(sorted(n.rel)), n.label or "")
                      for n in sorted(p.nodes, key=_rank))
        return (*brief(p), shape, tags(p.kind), p.kind)

    # The full key reads every node: only kinds alike in their totals need it.
    briefs = [brief(p) for p in pools]
    ordered = sorted(pools, key=full if len(set(briefs)) < len(briefs) else brief)
    for i, p in enumerate(ordered):
        p.rank = i
    return ordered
