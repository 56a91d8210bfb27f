"""The pass behind ``policy.decide``: pure, but written for ~10^4 waiting jobs and ~10^3 nodes.

What it knows of the nodes is in ``capacity.py`` (per-kind pools bucketed by free GPUs, canonical
ranks, fragmentation costs); a shape that did not fit is not tried again until capacity grows.
Ties are broken by canonical ranks, never by names or input order. Times are POSIX seconds; INF
is "no time limit".
"""

from __future__ import annotations

import bisect
import heapq
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import UTC, datetime

from control_plane.scheduler.capacity import (
    CLAIM_UNIT,
    Hold,
    KindPool,
    NodeState,
    hold_need,
    rank_nodes,
    rank_pools,
)
from control_plane.scheduler.model import (
    DEFAULT_TENANT,
    INF,
    WAIT_BEHIND,
    WAIT_CAPACITY,
    WAIT_NEVER,
    WAIT_QUOTA,
    WAIT_RESERVED,
    Decision,
    HeldNode,
    JobDemand,
    NodeCapacity,
    Placement,
    PolicyOptions,
    Reservation,
    ReserveHold,
    TenantShare,
)


def rank_order(nodes: Sequence[NodeState]) -> list[NodeState]:
    """The node ranks of a gang: the nodes of one topology domain adjacent (the largest domain
    first, nodes without a label last), by name inside a domain. torchrun numbers ranks node by
    node in this order (node_agent/launcher.py), so a ring all-reduce crosses between domains as
    few times as possible and a layout's inner mesh dimension never leaves a node. (Which nodes a
    gang gets never depends on names; only the numbering of the chosen ones does.)"""
    sizes: dict[str | None, int] = {}
    for n in nodes:
        sizes[n.label] = sizes.get(n.label, 0) + 1
    return sorted(nodes, key=lambda n: (n.label is None, -sizes[n.label], n.label or "", n.name))


class Pass:
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

    # -- the pass -----------------------------------------------------------------------------------

    def run(self) -> Decision:
        jobs_by_id = {j.job_id: j for j in self.jobs}
        if self.opts.mode == "fair":
            self._keep_previous(jobs_by_id)
        self._hold_healthy()
        self._pick_recovery_reserve()
        waiting = self.decision.waiting
        blocked: list[tuple[JobDemand, float, int]] = []  # (job, end, drops when it was tried)
        order = self._service_order()
        for j in order:
            self.unserved.discard(j.job_id)
            if self._over_quota(j):
                waiting[j.job_id] = WAIT_QUOTA
                self._drop(self.res_of.get(j.job_id))
                continue
            jend = self.now + j.time_limit_s if j.time_limit_s else INF
            queued = self.held_for_queue
            placement = self.try_place(j, jend)
            if placement is not None:
                self.decision.placements.append(placement)
                if self.held_for_queue < queued:
                    self._reserve_again(blocked)
                continue
            waiting[j.job_id] = self._blocked(j)
            blocked.append((j, jend, self.drops))
            if self.opts.mode == "fifo":
                for rest in order:
                    waiting[rest.job_id] = WAIT_BEHIND
            elif self.free_total == 0 and not j.recovering and not self._any_room():
                # Nothing can be placed and no reservation made (recovering jobs come first); a
                # job served later may still hold the reservation kept from the last pass.
                for rest in order:
                    waiting[rest.job_id] = WAIT_RESERVED if rest.job_id in self.res_of else WAIT_CAPACITY
        if self.opts.mode != "fifo":
            self._retry(blocked)
        self._report()
        return self.decision

    def _retry(self, blocked: list[tuple[JobDemand, float, int]]) -> None:
        """A hold dropped later in the pass (its job started elsewhere, or is over its quota) gave
        capacity back: try again, in service order, the jobs that were blocked before it."""
        while self.free_total and any(tried < self.drops for _, _, tried in blocked):
            again, blocked = blocked, []
            for j, jend, tried in again:
                if tried == self.drops or j.job_id not in self.decision.waiting:
                    blocked.append((j, jend, tried))
                    continue
                if self._over_quota(j):
                    self.decision.waiting[j.job_id] = WAIT_QUOTA
                    self._drop(self.res_of.get(j.job_id))
                    continue
                queued = self.held_for_queue
                placement = self.try_place(j, jend)
                if placement is not None:
                    self.decision.placements.append(placement)
                    del self.decision.waiting[j.job_id]
                    if self.held_for_queue < queued:
                        self._reserve_again(again)
                else:
                    blocked.append((j, jend, self.drops))

    def _reserve_again(self, blocked: list[tuple[JobDemand, float, int]]) -> None:
        """A job that started gave its reservation up: the jobs blocked before it without one (the
        reservations were all taken) get it, in service order, before any job served later."""
        waiting = self.decision.waiting
        for j, _, _ in blocked:
            if not self._any_room():
                return
            if waiting.get(j.job_id) == WAIT_CAPACITY and j.job_id not in self.res_of and self._may_reserve_more(j):
                waiting[j.job_id] = self._blocked(j)

    def _blocked(self, j: JobDemand) -> str:
        """``j`` does not fit now: keep, improve or make its reservation. Returns the wait reason."""
        held = self.res_of.get(j.job_id)
        if held is not None and held.partial:
            plan = self._plan(j)  # its healthy nodes are its own, so they are in the plan
            if plan is None:
                if self._fits_ever(j, self.pool_of[held.nodes[0].id]):
                    return WAIT_RESERVED  # the other nodes it needs are held for others: keep its own
                # Its healthy nodes' GPU kind can never hold it: holding them helps nobody.
                self._drop(held)
                plan = self._plan(j)
                if plan is None:
                    return WAIT_NEVER if self._never_fits(j) else WAIT_CAPACITY
                self._establish(j, *plan)
                return WAIT_RESERVED
            self._replace(held, *plan)
            return WAIT_RESERVED
        if held is not None:
            if held.start == INF:  # a better (finite) start may have appeared elsewhere
                better = self._plan(j)
                if better is not None and better[0] < INF:
                    self._replace(held, *better)
            return WAIT_RESERVED
        if not (j.recovering or self._may_reserve_more(j)):
            return WAIT_NEVER if self._never_fits(j) else WAIT_CAPACITY
        plan = self._plan(j)
        if plan is None:
            return WAIT_NEVER if self._never_fits(j) else WAIT_CAPACITY
        self._establish(j, *plan)
        return WAIT_RESERVED

    def _room(self, pool: KindPool, j: JobDemand) -> bool:
        """Whether ``j`` may hold a reservation on ``pool``'s kind: reservations are capped per
        kind (they hold only nodes of their kind, so a job waiting for a scarce kind is not kept
        from holding one by those waiting for others); recovering jobs always may."""
        if j.recovering:
            return True
        held = self.res_of.get(j.job_id)
        return pool.held < self.opts.max_reservations or (held is not None and held.pool is pool)

    def _may_reserve_more(self, j: JobDemand) -> bool:
        if self.opts.mode != "fair":
            return False
        if j.recovering or j.job_id in self.res_of:
            return any(self._room(p, j) for p in self._pools_for(j))
        # Asked for every blocked job of a deep queue: per kind list, until a reservation comes or goes.
        got = self.room_of.get(j.gpu_kinds)
        if got is None or got[0] != self.res_version + self.drops:
            room = any(p.held < self.opts.max_reservations for p in self._pools_for(j))
            got = self.room_of[j.gpu_kinds] = (self.res_version + self.drops, room)
        return got[1]

    def _any_room(self) -> bool:
        return self.opts.mode == "fair" and any(p.held < self.opts.max_reservations for p in self.ranked)

    def _over_quota(self, j: JobDemand) -> bool:
        quota = self.tenants.get(j.tenant, DEFAULT_TENANT).gpu_quota
        return quota is not None and self.usage.get(j.tenant, 0) + j.num_gpus > quota

    def _share(self, tenant: str) -> float:
        return self.usage.get(tenant, 0) / self.tenants.get(tenant, DEFAULT_TENANT).weight

    def _service_order(self) -> Iterator[JobDemand]:
        """Jobs in service order. The tenant share is read when a tenant's next job is due, so
        admissions earlier in the pass count (a generator: the caller admits between yields)."""
        classes: dict[tuple[bool, int], dict[str, list[JobDemand]]] = {}
        for j in self.jobs:
            classes.setdefault((not j.recovering, -j.priority), {}).setdefault(j.tenant, []).append(j)
        for key in sorted(classes):
            if not key[0]:  # recovering: they held a place already, the tenants' shares do not reorder them
                yield from sorted((j for js in classes[key].values() for j in js),
                                  key=lambda j: (j.submitted_at, j.job_id))
                continue
            queues = {t: deque(sorted(js, key=lambda j: (j.submitted_at, j.job_id)))
                      for t, js in classes[key].items()}
            if len(queues) == 1:
                yield from next(iter(queues.values()))
                continue
            heap = [(self._share(t), q[0].submitted_at, q[0].job_id, t) for t, q in queues.items()]
            heapq.heapify(heap)
            while heap:
                t = heapq.heappop(heap)[3]
                q = queues[t]
                yield q.popleft()
                if q:
                    heapq.heappush(heap, (self._share(t), q[0].submitted_at, q[0].job_id, t))

    # -- placing ------------------------------------------------------------------------------------

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

    # -- reservations -------------------------------------------------------------------------------

    def _never_fits(self, j: JobDemand) -> bool:
        if j.avoid_nodes:
            return self._never_fits_now(j)
        key = (j.gpu_kinds, j.gpus_per_node, j.num_nodes)
        if key not in self.never:  # node totals do not change during a pass
            self.never[key] = self._never_fits_now(j)
        return self.never[key]

    def _never_fits_now(self, j: JobDemand) -> bool:
        return not any(self._fits_ever(j, pool) for pool in self._pools_for(j))

    @staticmethod
    def _fits_ever(j: JobDemand, pool: KindPool) -> bool:
        """Whether the nodes of ``pool`` could hold ``j`` when empty (node totals, avoided nodes)."""
        g = j.gpus_per_node
        if g > pool.maxcap:
            return False
        avoided = sum(1 for nid in j.avoid_nodes if nid in pool.by_id and pool.by_id[nid].total >= g)
        return pool.total_ge[g] - avoided >= j.num_nodes

    def _plan(self, j: JobDemand) -> tuple[float, list[NodeState]] | None:
        """The nodes where ``j`` fits soonest (free now or released by time limits), among nodes
        no other reservation holds; its healthy nodes first if it is recovering."""
        best: tuple[float, list[NodeState]] | None = None
        held = self.res_of.get(j.job_id)
        # A recovering job's healthy nodes, held since the start of the pass, fix its GPU kind.
        if held is not None and held.partial:
            pools = [held.pool]
        else:  # the kinds with room for a reservation; on a tie, the kind flexible jobs prefer
            allowed = set(self._pools_for(j))
            pools = [p for p in self._by_preference() if p in allowed and self._room(p, j)]
        for pool in pools:
            plan = self._plan_in(j, pool)
            if plan is not None and (best is None or plan[0] < best[0]):
                best = plan
        return best

    def _plan_in(self, j: JobDemand, pool: KindPool) -> tuple[float, list[NodeState]] | None:
        g, k = j.gpus_per_node, j.num_nodes
        if g > pool.maxcap:
            return None
        prefer = j.prefer_nodes if j.recovering else frozenset()
        limit = j.time_limit_s or INF
        forced: list[tuple[float, NodeState]] = []
        others: list[tuple[float, int, int, NodeState]] = []
        for n in pool.nodes:
            if n.total < g or n.id in j.avoid_nodes or n.reserve:
                continue
            holds = [h for h in n.holds if h.job is not j]
            # A node held strictly, partly or for an unknown start (or a healthy node, which its
            # job holds strictly) is not shared; otherwise the job is planned around the holds.
            if holds and (n.strict or n.id in prefer or any(h.partial or h.start == INF for h in holds)):
                continue
            t = n.ready_beside(g, limit, self.now, holds)
            if holds and t == INF:
                continue
            if n.id in prefer:
                forced.append((t, n))
            else:
                # Ties: sooner, then the node that frees the most without forever-running jobs.
                others.append((t, -n.free_by(INF), n.rank, n))
        if len(forced) + len(others) < k:
            return None
        forced.sort(key=lambda x: (x[0], x[1].rank))
        forced = forced[:k]
        need = k - len(forced)
        chosen = [n for _, n in forced]
        if need:
            others.sort(key=lambda x: x[:3])
            cutoff = others[need - 1][0]
            within = (x[3] for x in others if x[0] <= cutoff)
            picked = self._choose(chosen, within, k)
            assert picked is not None  # at least ``need`` nodes are within the cutoff
            chosen = picked
        ready = {n.id: t for t, n in forced} | {x[3].id: x[0] for x in others}
        start = self._common_start(j, chosen, max(ready[n.id] for n in chosen))
        return None if start is None else (start, chosen)

    def _common_start(self, j: JobDemand, nodes: list[NodeState], t: float,
                      among: set[Hold] | None = None) -> float | None:
        """The earliest time from ``t`` at which ``j``'s reservation fits on all ``nodes`` beside
        their other reservations (those in ``among``, if given; None: never, with a known start,
        where it shares a node)."""
        g, limit = j.gpus_per_node, j.time_limit_s or INF
        beside = [(n, self._beside(j, n, among)) for n in nodes]
        while t < INF:
            if all(not hs or n.fits(g, t, t + limit, hs) for n, hs in beside):
                return t
            t = min((x for n, hs in beside for x in n.times(self.now, hs) if x > t), default=INF)
        return INF if all(not hs for _, hs in beside) else None

    def _establish(self, j: JobDemand, start: float, nodes: list[NodeState], partial: bool = False) -> None:
        res = Hold(j, start, [], self.pool_of[nodes[0].id], partial)
        for n in nodes:
            self._attach(res, n)
        self.res_of[j.job_id] = res
        self.held_for_queue += not j.recovering
        res.pool.held += not j.recovering
        self.starts = None
        self.res_version += 1

    def _attach(self, res: Hold, n: NodeState) -> None:
        j = res.job
        res.nodes.append(n)
        n.holds.append(res)
        if j.recovering and n.id in j.prefer_nodes:  # only on a node no other reservation holds
            n.strict = True
            n.guard = max(j.gpus_per_node, self.guard_of.get(n.id, 0))
        self.pool_of[n.id].reindex(n)

    def _replace(self, old: Hold, start: float, nodes: list[NodeState]) -> None:
        """Move a job's hold to ``nodes``; only the nodes it leaves are offered to others."""
        self._drop(old, rehold=False)
        self._establish(old.job, start, nodes)
        if old.job.recovering and self.unserved:
            self._rehold([n for n in old.nodes if not n.holds])

    def _drop(self, res: Hold | None, *, rehold: bool = True) -> None:
        if res is None:
            return
        del self.res_of[res.job.job_id]
        self.held_for_queue -= not res.job.recovering
        res.pool.held -= not res.job.recovering
        self.starts = None
        self.drops += 1
        for n in res.nodes:
            n.holds.remove(res)
            if not n.holds:
                n.strict = False
                n.guard = 0
            self.pool_of[n.id].reindex(n)
        self.failed.clear()  # capacity grew: shapes that failed may fit now
        if rehold and res.job.recovering and self.unserved:
            self._rehold(res.nodes)

    def _keep_previous(self, jobs: Mapping[str, JobDemand]) -> None:
        """Re-establish last pass's reservations on the same nodes while they can hold the job:
        first all at their last earliest start (later ones were planned around earlier ones, and
        the other way round), then each moved to its earliest start beside all the others (earlier,
        unless what it waits for now ends later than the last pass counted on)."""
        kept_res: list[Hold] = []
        for job_id, node_ids in self.previous.items():
            j = jobs.get(job_id)
            if j is None:
                continue
            nodes = [self.by_id.get(nid) for nid in node_ids]
            if len(nodes) != j.num_nodes or any(
                n is None or n.strict or (n.holds and (j.recovering and n.id in j.prefer_nodes))
                or n.total < j.gpus_per_node or n.id in j.avoid_nodes
                or (n.id in self.healthy and n.id not in j.prefer_nodes)
                or (j.gpu_kinds is not None and n.kind not in j.gpu_kinds)
                for n in nodes
            ):
                continue
            kept = [n for n in nodes if n is not None]
            if len({n.kind for n in kept}) != 1 or not self._room(self.pool_of[kept[0].id], j):
                continue
            if job_id in self.previous_starts:
                last = self.previous_starts[job_id]
                start: float | None = max(self.now, last.timestamp()) if last is not None else INF
            else:
                start = self._earliest_beside(j, kept)
            if start is None:
                continue
            self._establish(j, start, kept)
            kept_res.append(self.res_of[job_id])
        for i, res in enumerate(kept_res):
            earlier = set(kept_res[:i])
            if self._fits_at(res, earlier):
                # Earlier where that delays none of the others.
                better = self._earliest_beside(res.job, res.nodes)
                better = better if better is not None and better < res.start else None
            else:
                # What it waits for ends later than the last pass counted on (an attempt still
                # stopping): it goes later, before the reservations made after it (they move).
                better = self._earliest_beside(res.job, res.nodes, earlier)
            if better is not None:
                res.start = better
                for n in res.nodes:
                    self.pool_of[n.id].reindex(n)
                self.starts = None

    @staticmethod
    def _beside(j: JobDemand, n: NodeState, among: set[Hold] | None) -> list[Hold]:
        return [h for h in n.holds if h.job is not j and (among is None or h in among)]

    def _fits_at(self, res: Hold, among: set[Hold]) -> bool:
        """Whether ``res`` can start at its start beside the reservations in ``among``."""
        g = res.share
        if res.start == INF:
            return True
        if res.start < self.now:
            return False
        return all(n.fits(g, res.start, res.end, hs) if (hs := self._beside(res.job, n, among))
                   else n.free_by(res.start) >= g for n in res.nodes)

    def _earliest_beside(self, j: JobDemand, nodes: list[NodeState], among: set[Hold] | None = None) -> float | None:
        g, limit = j.gpus_per_node, j.time_limit_s or INF
        t = 0.0
        for n in nodes:
            holds = self._beside(j, n, among)
            ready = n.ready_beside(g, limit, self.now, holds)
            if holds and ready == INF:
                return None
            t = max(t, ready)
        return self._common_start(j, nodes, t, among)

    def _hold_healthy(self) -> None:
        """Hold every recovering job's healthy nodes from the start of the pass: nobody else, not
        even a job served before it, takes its share of them (it uses them first if it fits)."""
        for j in self.recovering:
            self._hold_one(j)

    def _hold_one(self, j: JobDemand) -> None:
        """Hold ``j``'s free healthy nodes (or add those freed since to its partial hold)."""
        held = self.res_of.get(j.job_id)
        # Usage only grows during a pass: a job over its quota now stays so, and holds nothing.
        if (not j.prefer_nodes or (held is not None and not held.partial) or self._over_quota(j)
                or self._never_fits(j)):
            return
        by_kind: dict[str, list[NodeState]] = {}
        for n in self._nodes(j.prefer_nodes):
            if (not n.holds and not n.reserve and n.total >= j.gpus_per_node
                    and n.id not in j.avoid_nodes and (j.gpu_kinds is None or n.kind in j.gpu_kinds)):
                by_kind.setdefault(n.kind, []).append(n)
        if held is not None:
            for n in by_kind.get(held.pool.kind, [])[: j.num_nodes - len(held.nodes)]:
                self._attach(held, n)
        elif by_kind:  # a gang is of one kind: the kind most of its healthy nodes are
            nodes = max(by_kind.items(), key=lambda kv: (len(kv[1]), -self.pools[kv[0]].rank))[1]
            self._establish(j, INF, nodes[: j.num_nodes], partial=True)

    def _nodes(self, ids: frozenset[str]) -> list[NodeState]:
        """The nodes of these ids that take part in the pass, in rank order."""
        return sorted((self.by_id[nid] for nid in ids if nid in self.by_id), key=lambda n: n.rank)

    def _rehold(self, freed: list[NodeState]) -> None:
        """A recovering job's hold was dropped: recovering jobs not served yet that share those
        healthy nodes hold them now, before anyone else is served."""
        ids = {n.id for n in freed}
        for j in self.recovering:
            if j.job_id in self.unserved and ids & j.prefer_nodes:
                self._hold_one(j)

    def _pick_recovery_reserve(self) -> None:
        """Per GPU kind, the nodes with the most free GPUs that no reservation holds run
        recovering jobs only; they drain into whole idle nodes as their jobs end."""
        for pool in self.ranked:
            want = self.opts.reserve_nodes(pool.kind)
            if not want:
                continue
            free_nodes = sorted((n for n in pool.nodes if not n.holds and n.id not in self.healthy),
                                key=lambda n: (-len(n.free), n.rank))
            for n in free_nodes[:want]:
                n.reserve = True
                pool.reindex(n)
                pool.reserve.append(n)

    def _report(self) -> None:
        for res in self.res_of.values():
            self.decision.reservations.append(Reservation(
                job_id=res.job.job_id,
                earliest_start=datetime.fromtimestamp(res.start, UTC) if res.start < INF else None,
                nodes=tuple(HeldNode(node_id=n.id, gpus=res.share,
                                     free_at_start=n.free_by(res.start) - hold_need(res, n.holds) + res.share,
                                     held=len(n.free) - n.general() if n.holds[0] is res else 0,
                                     strict=n.strict) for n in res.nodes),
            ))
        for pool in self.ranked:
            if pool.reserve:
                self.decision.recovery_reserve.append(ReserveHold(
                    gpu_kind=pool.kind, node_ids=tuple(n.id for n in pool.reserve),
                    idle_gpus=sum(len(n.free) for n in pool.reserve),
                ))
