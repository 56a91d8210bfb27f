"""The pass behind ``policy.decide``: pure, but written for ~10^4 waiting jobs and ~10^3 nodes.

What it knows of the nodes is in ``capacity.py`` (per-kind pools bucketed by free GPUs, canonical
ranks, fragmentation costs); a shape that did not fit is not tried again until capacity grows.
Ties are broken by canonical ranks, never by names or input order. Times are POSIX seconds; INF
is "no time limit".
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from control_plane.scheduler.model import (
    INF,
    WAIT_BEHIND,
    WAIT_CAPACITY,
    WAIT_NEVER,
    WAIT_QUOTA,
    WAIT_RESERVED,
    Decision,
    JobDemand,
)
from control_plane.scheduler.placing import Placing
from control_plane.scheduler.reserving import Reserving


class Pass(Placing, Reserving):
    """One pass: its state and look-ups (``pass_base.py``), placing (``placing.py``), reserving
    (``reserving.py``); here the order of service and what a blocked job gets."""

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
