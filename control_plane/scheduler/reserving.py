"""Reservations during a pass (``Reserving``): the nodes where a blocked job fits soonest, kept
from pass to pass, capped per GPU kind; a recovering job's healthy nodes held strictly; the
recovery reserve; and what the decision reports of them (docs/architecture.md, "Reservations").
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from control_plane.scheduler.capacity import (
    Hold,
    KindPool,
    NodeState,
    hold_need,
)
from control_plane.scheduler.model import (
    INF,
    HeldNode,
    JobDemand,
    Reservation,
    ReserveHold,
)
from control_plane.scheduler.pass_base import PassBase


class Reserving(PassBase):
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
            return
        # A gang is of one kind: the kind most of its healthy nodes are, among the kinds that could
        # ever hold it. Held in a kind that never could, its hold would be dropped when its turn
        # came (_blocked) and moved to another kind's healthy nodes, which jobs served before it
        # had been free to take meanwhile.
        fits = {kind: nodes for kind, nodes in by_kind.items() if self._fits_ever(j, self.pools[kind])}
        if fits:
            nodes = max(fits.items(), key=lambda kv: (len(kv[1]), -self.pools[kv[0]].rank))[1]
            self._establish(j, INF, nodes[: j.num_nodes], partial=True)

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
