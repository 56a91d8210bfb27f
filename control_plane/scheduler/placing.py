"""Placing a job now (``Placing``): which kind, which nodes, which GPUs. Nodes come from a pool's
buckets in the order that takes the least capacity the waiting shapes need, a gang inside one
topology domain if it can be, and never from a reservation's share unless it backfills.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from control_plane.scheduler.capacity import (
    CLAIM_UNIT,
    KindPool,
    NodeState,
)
from control_plane.scheduler.model import (
    INF,
    JobDemand,
    Placement,
)
from control_plane.scheduler.pass_base import PassBase


def rank_order(nodes: Sequence[NodeState]) -> list[NodeState]:
    """The node ranks of a gang: the nodes of one topology domain adjacent (the largest domain
    first, nodes without a label last), by name inside a domain. torchrun numbers ranks node by
    node in this order (node_agent/part/commands.py), so a ring all-reduce crosses between domains as
    few times as possible and a layout's inner mesh dimension never leaves a node. (Which nodes a
    gang gets never depends on names; only the numbering of the chosen ones does.)"""
    sizes: dict[str | None, int] = {}
    for n in nodes:
        sizes[n.label] = sizes.get(n.label, 0) + 1
    return sorted(nodes, key=lambda n: (n.label is None, -sizes[n.label], n.label or "", n.name))


class Placing(PassBase):
    def _usable(self, n: NodeState, j: JobDemand, jend: float) -> int:
        """GPUs ``j`` may take on ``n`` now without delaying any reservation."""
        if n.reserve:
            return len(n.free) if j.recovering else 0
        # Backfill (its GPUs are back before a reservation starts) or beyond what they need then.
        return n.allowed(j, jend)

    def _special(self, j: JobDemand, jend: float, pool: KindPool, g: int) -> tuple[list[NodeState], list[NodeState]]:
        """Nodes where ``j`` may take more than an ordinary job and that hold its share: (its own
        reservation's and reserved nodes it can backfill, to use first; recovery-reserve nodes for
        a recovering job, to use last)."""
        own: list[NodeState] = []
        holes: list[NodeState] = []
        mine = self.res_of.get(j.job_id)
        # Only a job with a time limit can backfill; otherwise only its own reservation counts.
        holds = self.res_of.values() if jend < INF else (() if mine is None else (mine,))
        seen: set[str] = set()
        for r in holds:
            if r.pool is not pool or not (r is mine or jend <= r.start):
                continue
            for n in r.nodes:
                if (n.id not in seen and n.key < g <= len(n.free)
                        and (r is mine or not n.strict) and n.allowed(j, jend) >= g):
                    seen.add(n.id)
                    (own if r is mine else holes).append(n)
        holes.sort(key=lambda n: (len(n.free), n.rank))
        spare = [n for n in pool.reserve if len(n.free) >= g] if j.recovering else []
        return own + holes, spare

    def try_place(self, j: JobDemand, jend: float) -> Placement | None:
        plain = self._plain(j)
        if plain:
            # One look for a job that fits none of its kinds (most of a deep queue, most passes).
            shape = (j.gpu_kinds, j.gpus_per_node, j.num_nodes, self._backfills(jend), self.res_version)
            if shape in self.failed:
                return None
        pools = self._pools_for(j)
        if len(pools) > 1 and self.opts.placement == "scored":
            found = self._fit_scored(j, jend, pools)
        else:
            found = next(((p, c) for p in pools if (c := self._fit(j, jend, p)) is not None), None)
        if found is None:
            if plain:
                self.failed.add(shape)
            return None
        return self._commit(j, jend, *found)

    def _fit_scored(self, j: JobDemand, jend: float, pools: list[KindPool]
                    ) -> tuple[KindPool, list[NodeState]] | None:
        """A job that may use several kinds goes where it takes the least capacity that jobs naming
        their kinds wait for (``KindPool.conflict``); then to the kind with the most free capacity
        relative to its demand (``KindPool.preference``); then to the nodes that take the least
        capacity from all waiting shapes (``KindPool.score``), then the first kind in rank."""
        g = j.gpus_per_node
        allowed = set(pools)
        best: tuple[tuple[int, float, float, int], KindPool, list[NodeState]] | None = None
        for pool in self._by_preference():
            if pool not in allowed:
                continue
            level = -pool.preference()
            if best is not None and best[0][0] == 0 and level > best[0][1]:
                break  # no conflict already, and every kind left is less preferred
            chosen = self._fit(j, jend, pool)
            if chosen is None:
                continue
            key = (pool.conflict(chosen, g), level, pool.score(chosen, g), pool.rank)
            if best is None or key < best[0]:
                best = (key, pool, chosen)
        return None if best is None else (best[1], best[2])

    def _fit(self, j: JobDemand, jend: float, pool: KindPool) -> list[NodeState] | None:
        g, k = j.gpus_per_node, j.num_nodes
        if g > pool.maxcap:
            return None
        plain = self._plain(j)
        if plain:
            shape = (pool.kind, g, k, self._backfills(jend), self.res_version)
            if shape in self.failed:
                return None
        first, last = self._special(j, jend, pool, g)
        if pool.count_ge(g) + len(first) + len(last) < k:
            if plain:
                self.failed.add(shape)
            return None
        avoid = j.avoid_nodes
        pinned: list[NodeState] = []
        for n in self._nodes(j.prefer_nodes):
            if (len(pinned) < k and self.pool_of[n.id] is pool and n.id not in avoid
                    and self._usable(n, j, jend) >= g):
                pinned.append(n)
        skip = {n.id for n in pinned} | avoid

        def candidates() -> Iterator[NodeState]:
            seen: set[str] = set()
            for n in first:
                if n.id not in skip:
                    seen.add(n.id)
                    yield n
            for b in pool.order[g]:
                for n in pool.buckets[b]:
                    if n.id not in skip and n.id not in seen:
                        yield n
            for n in last:
                if n.id not in skip:
                    yield n

        chosen = self._choose(pinned, candidates(), k)
        if chosen is None and plain:
            self.failed.add(shape)
        return chosen

    def _commit(self, j: JobDemand, jend: float, pool: KindPool, chosen: list[NodeState]) -> Placement:
        g = j.gpus_per_node
        backfill = from_reserve = False
        parts = []
        for n in rank_order(chosen):
            taken = tuple(n.free[:g])
            del n.free[:g]
            if not n.strict and any(r.job is not j and jend < INF and jend <= r.start for r in n.holds):
                backfill = True  # back before a start: what that reservation counts on is intact
            from_reserve |= n.reserve
            n.rel.append((jend, g))
            pool.reindex(n)
            parts.append((n.id, taken))
        pool.free -= j.num_gpus
        if j.gpu_kinds is not None:  # what it claimed on each of its kinds is served
            eligible = self._eligible(g, j.num_nodes, j.gpu_kinds)
            for p in eligible:
                p.claims[g] = p.claims.get(g, 0) - j.num_gpus * CLAIM_UNIT // len(eligible)
        self.preferred = None
        self.free_total -= j.num_gpus
        self.usage[j.tenant] = self.usage.get(j.tenant, 0) + j.num_gpus
        self._drop(self.res_of.get(j.job_id))  # it starts: its reservation ends
        return Placement(job_id=j.job_id, nodes=tuple(parts), gpu_kind=pool.kind, backfill=backfill,
                         from_reserve=from_reserve)
