"""A discrete-event model of one long job on N nodes (``trainyard simulate``, POST /v1/simulations).

Pure and seeded. Failures arrive as a Poisson process (each node fails at 1 / node MTBF, so the job
at N / node MTBF); nothing fails during a recovery. Training runs in segments: ``interval_s`` of
compute, then the save blocks ``blocking_s``; an asynchronous save then uploads for ``background_s``
while training goes on, and is durable only when that ends (a save that comes while the previous one
still uploads waits for it: at most one in flight). A failure rolls the job back to the last durable
save. It then needs a healthy node in place of the failed one: a spare if one is free (the failed node
is repaired in ``repair_h`` and becomes a spare), else it waits for the first repair; then the
recovery takes ``recovery_s``. Between failures everything is deterministic, so the model jumps from
failure to failure: a run costs O(failures), not O(checkpoints).

docs/goodput.md checks it against the closed form (a synchronous save, spares at hand): the expected
time of a segment of T = interval + blocking is (MTBF + R)(e^(T/MTBF) - 1).
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, replace

from control_plane.goodput.rules import young_daly_interval_s


@dataclass(frozen=True, kw_only=True)
class Scenario:
    nodes: int
    node_mtbf_h: float
    work_h: float
    """Compute the job needs, in hours of training (what a failure-free run without saves takes)."""
    interval_s: float
    """Compute between saves."""
    blocking_s: float
    background_s: float = 0.0
    recovery_s: float = 600.0
    spares: int | None = None
    """Healthy nodes that can replace a failed one at once; None: always one at hand."""
    repair_h: float = 24.0
    seed: int = 0
    max_failures: int | None = None
    """Stop a run that has failed this many times (TooManyFailures): a job whose saves rarely
    finish between failures progresses so slowly that the run would go on for good."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.node_mtbf_h <= 0 or self.work_h <= 0 or self.interval_s <= 0:
            raise ValueError("nodes, node_mtbf_h, work_h and interval_s must be positive")
        if min(self.blocking_s, self.background_s, self.recovery_s, self.repair_h) < 0:
            raise ValueError("costs and times must not be negative")
        if self.spares is not None and self.spares < 0:
            raise ValueError("spares must be >= 0")

    @property
    def job_mtbf_s(self) -> float:
        return self.node_mtbf_h * 3600.0 / self.nodes


@dataclass(frozen=True)
class Outcome:
    wall_s: float
    work_s: float
    stall_s: float
    lost_s: float
    recovery_s: float
    waiting_s: float
    """Waiting for a repaired node when no spare was free."""
    failures: int
    saves: int

    @property
    def goodput(self) -> float:
        return self.work_s / self.wall_s if self.wall_s > 0 else 0.0


class TooManyFailures(ValueError):
    """A run reached its scenario's max_failures before the job's work was done."""


def run(s: Scenario) -> Outcome:
    """One simulated run to the end of the job's work."""
    rng = random.Random(s.seed)
    work = s.work_h * 3600.0
    tau, delta, beta = s.interval_s, s.blocking_s, s.background_s
    stall_per = delta + max(0.0, beta - tau)  # a save waits for the previous upload
    seg = tau + stall_per
    t = durable = 0.0
    stall = lost = recovery = waiting = 0.0
    failures = saves = 0
    free = s.spares
    repairs: list[float] = []
    rate = 1.0 / s.job_mtbf_s
    while True:
        fail_at = t + rng.expovariate(rate)
        remaining = work - durable
        full = max(math.ceil(remaining / tau) - 1, 0)  # segments that end with a save
        finish = t + full * seg + (remaining - full * tau)
        if finish <= fail_at:
            saves += full
            stall += full * stall_per
            return Outcome(wall_s=finish, work_s=work, stall_s=stall, lost_s=lost, recovery_s=recovery,
                           waiting_s=waiting, failures=failures, saves=saves)
        elapsed = fail_at - t
        n = min(int(elapsed // seg), full)  # saves finished before the failure
        into = elapsed - n * seg
        done = n * tau + min(tau, into)
        in_stall = max(0.0, into - tau) if n < full else 0.0
        # The last finished save is durable once its upload is over (the earlier ones are).
        kept = n if n == 0 or into >= beta else n - 1
        saves += n
        stall += n * stall_per + in_stall
        lost += done - kept * tau
        durable += kept * tau
        failures += 1
        if s.max_failures is not None and failures > s.max_failures:
            raise TooManyFailures(f"over {s.max_failures} failures before {s.work_h:g}h of work were saved "
                                  f"({durable / 3600:.3g}h so far)")
        t = fail_at
        if free is not None:
            heapq.heappush(repairs, t + s.repair_h * 3600.0)  # the failed node, back repaired
            while repairs and repairs[0] <= t:
                heapq.heappop(repairs)
                free += 1
            if free == 0:  # no spare: wait for the first node back (perhaps the failed one)
                back = heapq.heappop(repairs)
                waiting += back - t
                t = back
            else:
                free -= 1
        t += s.recovery_s
        recovery += s.recovery_s


def mean_outcome(s: Scenario, runs: int) -> Outcome:
    """The average of ``runs`` runs with seeds seed, seed + 1, ..."""
    outs = [run(replace(s, seed=s.seed + i)) for i in range(max(runs, 1))]
    k = len(outs)
    return Outcome(**{f: sum(getattr(o, f) for o in outs) / k for f in (
        "wall_s", "work_s", "stall_s", "lost_s", "recovery_s", "waiting_s")},
        failures=round(sum(o.failures for o in outs) / k), saves=round(sum(o.saves for o in outs) / k))


def closed_form_goodput(interval_s: float, blocking_s: float, mtbf_s: float, recovery_s: float) -> float:
    """Expected goodput of synchronous saves with a node always at hand, for exponential failures
    that spare the recovery: interval / ((MTBF + R) (e^(T / MTBF) - 1)), T = interval + blocking."""
    try:
        segment = (mtbf_s + recovery_s) * math.expm1((interval_s + blocking_s) / mtbf_s)
    except OverflowError:  # a segment hundreds of MTBFs long: it practically never ends
        return 0.0
    return interval_s / segment


def sweep(s: Scenario, runs: int, factors: tuple[float, ...] = (
        0.25, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0, 2.8, 4.0)) -> list[tuple[float, float]]:
    """Goodput at intervals around Young's (common random numbers: the same failures for each)."""
    young = young_daly_interval_s(s.blocking_s, s.job_mtbf_s)
    base = young if math.isfinite(young) and young > 0 else s.interval_s
    # The interval reported is the one simulated: rounded as shown, never below a millisecond (a
    # Young interval of a save that costs nothing rounded to 0, which no scenario may have).
    return [(max(round(base * f, 3), 1e-3), mean_outcome(replace(s, interval_s=max(base * f, 1e-3)), runs).goodput)
            for f in factors]
