"""What a pass knows when it starts (``PassBase``): the nodes as per-kind pools in canonical rank,
the recovering jobs and their healthy nodes, each kind's share of the waiting demand; and the
look-ups the placing (``placing.py``) and the reserving (``reserving.py``) halves of a pass share.
``engine.py`` runs the pass. Times are POSIX seconds; INF is "no time limit".
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime

from control_plane.scheduler.capacity import (
    CLAIM_UNIT,
    Hold,
    KindPool,
    NodeState,
    rank_nodes,
    rank_pools,
)
from control_plane.scheduler.model import (
    DEFAULT_TENANT,
    INF,
    Decision,
    JobDemand,
    NodeCapacity,
    PolicyOptions,
    TenantShare,
)


class PassBase(ABC):
    def __init__(
        self,
        jobs: list[JobDemand],
        nodes: Sequence[NodeCapacity],
        *,
        now: datetime,
        tenants: Mapping[str, TenantShare],
        previous: Mapping[str, Sequence[str]],
        options: PolicyOptions,
        previous_starts: Mapping[str, datetime | None] | None = None,
    ) -> None:
        self.jobs = jobs
        self.previous_starts = previous_starts or {}
        self.now = now.timestamp()
        self.opts = options
        self.tenants = tenants
        self.previous = previous
        self.usage = {t: s.gpus_in_use for t, s in tenants.items()}
        by_kind: dict[str, list[NodeState]] = {}
        for cap in nodes:
            by_kind.setdefault(cap.gpu_kind, []).append(NodeState(cap, options.topology_label))
        self.by_id = {n.id: n for ns in by_kind.values() for n in ns}
        node_tags, kind_tags = self._tags(jobs)
        rank_nodes(list(self.by_id.values()), node_tags)
        pools = [KindPool(k, sorted(ns, key=lambda n: n.rank)) for k, ns in by_kind.items()]
        self.ranked = rank_pools(pools, kind_tags)
        """Every pool in canonical order (first-fit tries them so)."""
        self.pools = {p.kind: p for p in self.ranked}
        self.pool_of = {n.id: pool for pool in self.ranked for n in pool.nodes}
        self.free_total = sum(len(n.free) for n in self.by_id.values())
        self.preferred: list[KindPool] | None = None  # pools by preference (None: to recompute)
        self.res_of: dict[str, Hold] = {}  # job id -> its reservation, in the order they were made
        self.failed: set[tuple[object, ...]] = set()  # shapes that did not fit (cleared when capacity grows)
        self.drops = 0  # holds dropped so far: each gives capacity back
        self.held_for_queue = 0  # reservations of jobs that are not recovering (capped per kind: KindPool.held)
        self.starts: list[float] | None = None  # reservations' starts, sorted (None: to recompute)
        self.res_version = 0  # bumped by every new reservation: part of a failed shape's key
        self.never: dict[tuple[frozenset[str] | None, int, int], bool] = {}
        self.kinds_of: dict[frozenset[str] | None, list[KindPool]] = {}  # pools a kind list names
        self.room_of: dict[frozenset[str] | None, tuple[int, bool]] = {}  # kind list -> (holds version, room)
        self.eligible_of: dict[tuple[int, int, frozenset[str] | None], list[KindPool]] = {}
        # Healthy nodes of recovering jobs: held for them, so never in another hold.
        # In service order: recovering jobs go by priority and submit time (they held a place).
        self.recovering = sorted((j for j in jobs if j.recovering),
                                 key=lambda j: (-j.priority, j.submitted_at, j.job_id))
        self.healthy = {nid for j in self.recovering for nid in j.prefer_nodes}
        self.unserved = {j.job_id for j in self.recovering}  # recovering jobs whose turn has not come
        # A healthy node shared by recovering jobs is kept, for the whole pass, for the largest share
        # among them (jobs over their quota hold nothing; usage only grows during a pass).
        self.guard_of: dict[str, int] = {}
        for j in self.recovering:
            if not self._over_quota(j):
                for nid in j.prefer_nodes:
                    self.guard_of[nid] = max(self.guard_of.get(nid, 0), j.gpus_per_node)
        self._weigh(jobs)
        self.decision = Decision()

    def _tags(self, jobs: list[JobDemand]
              ) -> tuple[dict[str, tuple[object, ...]], Callable[[str], tuple[object, ...]]]:
        """What besides capacity sets a node or a kind apart, for the canonical ranks: the jobs
        that prefer, avoid or held (last pass) a node; the jobs that name a kind, and its recovery
        reserve."""
        marks: dict[str, list[tuple[int, str]]] = {}
        named: dict[str, list[str]] = {}
        for j in jobs:
            if j.prefer_nodes or j.avoid_nodes:
                for nid in j.prefer_nodes:
                    marks.setdefault(nid, []).append((0, j.job_id))
                for nid in j.avoid_nodes:
                    marks.setdefault(nid, []).append((1, j.job_id))
            if j.gpu_kinds:
                for kind in j.gpu_kinds:
                    named.setdefault(kind, []).append(j.job_id)
        for job_id, nids in self.previous.items():
            for i, nid in enumerate(nids):
                marks.setdefault(nid, []).append((2 + i, job_id))
        def kind_tags(kind: str) -> tuple[object, ...]:  # only read for kinds alike in all else
            return (self.opts.reserve_nodes(kind), tuple(sorted(named.get(kind, ()))))

        return {nid: tuple(sorted(m)) for nid, m in marks.items()}, kind_tags

    def _weigh(self, jobs: list[JobDemand]) -> None:
        """Each pool's share of the waiting demand (``KindPool.weigh``): every job's GPUs split
        evenly over the kinds it may use and that could ever hold it; and the claims of the jobs
        that name their kinds (``KindPool.claims``)."""
        need: dict[KindPool, list[float]] = {p: [] for p in self.ranked}
        by_share: dict[KindPool, dict[int, list[float]]] = {p: {} for p in self.ranked}
        for (g, k, kinds), count in Counter((j.gpus_per_node, j.num_nodes, j.gpu_kinds) for j in jobs).items():
            eligible = self._eligible(g, k, kinds)
            for p in eligible:
                share = count * g * k / len(eligible)
                need[p].append(share)
                by_share[p].setdefault(g, []).append(share)
                if kinds is not None:
                    p.claims[g] = p.claims.get(g, 0) + count * g * k * CLAIM_UNIT // len(eligible)
        for p in self.ranked:
            p.weigh(need[p], by_share[p], self.opts.placement == "scored")

    def _eligible(self, g: int, k: int, kinds: frozenset[str] | None) -> list[KindPool]:
        """The pools of these kinds that could ever hold a gang of k x g."""
        key = (g, k, kinds)
        got = self.eligible_of.get(key)
        if got is None:
            got = self.eligible_of[key] = [p for p in self._kind_pools(kinds) if p.fits_ever(g, k)]
        return got

    def _over_quota(self, j: JobDemand) -> bool:
        quota = self.tenants.get(j.tenant, DEFAULT_TENANT).gpu_quota
        return quota is not None and self.usage.get(j.tenant, 0) + j.num_gpus > quota

    def _share(self, tenant: str) -> float:
        return self.usage.get(tenant, 0) / self.tenants.get(tenant, DEFAULT_TENANT).weight

    def _kind_pools(self, kinds: frozenset[str] | None) -> list[KindPool]:
        """The pools of these kinds (None: all), in canonical order."""
        got = self.kinds_of.get(kinds)
        if got is None:
            got = self.kinds_of[kinds] = list(self.ranked) if kinds is None else [
                p for p in self.ranked if p.kind in kinds]
        return got

    def _pools_for(self, j: JobDemand) -> list[KindPool]:
        return self._kind_pools(j.gpu_kinds)

    def _by_preference(self) -> list[KindPool]:
        """Pools by ``KindPool.preference`` (most free capacity relative to demand first), then rank."""
        if self.preferred is None:
            self.preferred = sorted(self.ranked, key=lambda p: (-p.preference(), p.rank))
        return self.preferred

    def _plain(self, j: JobDemand) -> bool:
        """Whether ``j`` is placed like any other job of its shape (no history, no reservation)."""
        return not (j.recovering or j.avoid_nodes or j.prefer_nodes or j.job_id in self.res_of)

    def _backfills(self, jend: float) -> int:
        """The reservations a job ending at ``jend`` may backfill are those starting no earlier than
        it ends: with the set of reservations (its version), their number says which."""
        if jend == INF:
            return 0
        if self.starts is None:
            self.starts = sorted(r.start for r in self.res_of.values())
        return len(self.starts) - bisect.bisect_left(self.starts, jend)

    def _nodes(self, ids: frozenset[str]) -> list[NodeState]:
        """The nodes of these ids that take part in the pass, in rank order."""
        return sorted((self.by_id[nid] for nid in ids if nid in self.by_id), key=lambda n: n.rank)

    def _choose(self, pinned: list[NodeState], stream: Iterator[NodeState], k: int) -> list[NodeState] | None:
        """``k`` nodes: the pinned ones, then from ``stream`` (best first), inside one topology
        domain if possible (the pinned nodes' domain first), else across the fewest domains."""
        need = k - len(pinned)
        if need <= 0:
            return pinned[:k]
        if not self.opts.topology_label:
            rest = [n for _, n in zip(range(need), stream, strict=False)]
            return pinned + rest if len(rest) == need else None
        target = pinned[0].label if pinned else None
        groups: dict[str | None, list[NodeState]] = {}
        seen = 0
        for n in stream:
            seen += 1
            grp = groups.setdefault(n.label, [])
            grp.append(n)
            if len(grp) >= need and (not pinned or n.label == target):
                return pinned + grp
        if seen < need:
            return None
        ordered = sorted(groups.items(), key=lambda kv: (kv[0] != target if pinned else False, -len(kv[1])))
        rest = []
        for _, grp in ordered:
            rest += grp[: need - len(rest)]
            if len(rest) == need:
                break
        return pinned + rest

    @abstractmethod
    def _drop(self, res: Hold | None, *, rehold: bool = True) -> None:
        """End the reservation ``res`` and give its capacity back: placing calls it when a reserved
        job starts, and ``reserving.Reserving`` implements it (a pass is both)."""
