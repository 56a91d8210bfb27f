"""The watchdogs' and the checkpoint interval's rules, as pure functions (docs/goodput.md).

- Hang: a running attempt whose step has not advanced for ``hang_timeout_s`` is hung. The timeout
  follows the attempt's own step time, plus its longest checkpoint stall (a synchronous save of a
  large model blocks for minutes), never below a floor; a job may set its own.
- Stragglers: a rank whose busy time per step (what it computes alone, outside collectives) is more
  than ``factor`` times the median of all the attempt's ranks. In synchronous training every rank's
  wall time per step is the same (the fast ones wait in the all-reduce), so wall time cannot tell.
- Interval: Young's rule, sqrt(2 x cost x MTBF), with the cost a save blocks training and the MTBF
  of the job's nodes together; never shorter than the background part of a save (one in flight).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass


def hang_timeout_s(*, step_time_s: float | None, longest_stall_s: float | None, floor_s: float,
                   multiplier: float, override_s: float | None = None) -> float:
    """Seconds without a new step after which an attempt is hung."""
    if override_s is not None:
        return override_s
    derived = multiplier * (step_time_s or 0.0) + (longest_stall_s or 0.0)
    return max(floor_s, derived)


@dataclass(frozen=True)
class RankTiming:
    node: str
    """Whatever names the rank's node to the caller (an attempt part's id)."""
    rank: int
    busy_s: float | None
    step_time_s: float | None = None


@dataclass(frozen=True)
class Straggler:
    node: str
    rank: int
    busy_s: float
    peers_busy_s: float
    ratio: float


def stragglers(ranks: Iterable[RankTiming], factor: float) -> list[Straggler]:
    """The ranks slower than ``factor`` x the median of all ranks, slowest first (at most one per
    node: the node's slowest). Busy time when every rank reports it, else wall step time."""
    ranks = list(ranks)
    use_busy = bool(ranks) and all(r.busy_s is not None for r in ranks)
    timed = [(r, r.busy_s if use_busy else r.step_time_s) for r in ranks]
    values = [v for _, v in timed if v is not None and v > 0]
    if len(values) < 2:
        return []
    median = statistics.median(values)
    slow: dict[str, Straggler] = {}
    for r, v in timed:
        if v is None or median <= 0 or v <= factor * median:
            continue
        found = Straggler(node=r.node, rank=r.rank, busy_s=v, peers_busy_s=median, ratio=round(v / median, 3))
        if r.node not in slow or found.busy_s > slow[r.node].busy_s:
            slow[r.node] = found
    return sorted(slow.values(), key=lambda s: -s.ratio)


def node_failure_rate_per_h(*, failures: int, node_hours: float, prior_mtbf_h: float, prior_weight_h: float) -> float:
    """Failures per node-hour: the cluster's history with a prior worth ``prior_weight_h`` node-hours
    at ``prior_mtbf_h`` (a gamma prior's posterior mean): the prior until history exists, the
    observed rate once node-hours far exceed the weight."""
    prior_failures = prior_weight_h / prior_mtbf_h
    hours = max(node_hours, 0.0) + prior_weight_h
    if hours <= 0:
        return 1.0 / prior_mtbf_h
    return (max(failures, 0) + prior_failures) / hours


def job_mtbf_s(node_rate_per_h: float, nodes: int) -> float:
    """Mean time between failures of a job on ``nodes`` nodes that fail independently."""
    rate = node_rate_per_h * max(nodes, 1)
    return math.inf if rate <= 0 else 3600.0 / rate


def young_daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval (compute between saves): sqrt(2 x cost x MTBF), at most
    the MTBF (the first-order rule holds for cost << MTBF; Daly's refinement changes it by under 3%
    at cost = MTBF / 50)."""
    if cost_s <= 0:
        return 0.0
    if math.isinf(mtbf_s):
        return math.inf
    return min(math.sqrt(2.0 * cost_s * mtbf_s), mtbf_s)


def waste_fraction(interval_s: float, cost_s: float, mtbf_s: float, recovery_s: float = 0.0) -> float:
    """First-order share of time lost: saves (cost / (interval + cost)) plus, per failure, half an
    interval recomputed and the recovery (Young, Daly)."""
    if interval_s <= 0:
        return 1.0
    per_failure = (interval_s + cost_s) / 2.0 + recovery_s
    return min(1.0, cost_s / (interval_s + cost_s) + (0.0 if math.isinf(mtbf_s) else per_failure / mtbf_s))


@dataclass(frozen=True)
class IntervalChoice:
    steps: int
    seconds: float
    young_s: float
    """sqrt(2 x cost x MTBF) before the bounds."""
    bound: str | None
    """Which bound set it, if one did: 'minimum', 'background' (the previous save still uploading)."""


def choose_interval(*, cost_s: float, background_s: float | None, mtbf_s: float, step_time_s: float,
                    min_s: float) -> IntervalChoice:
    """The interval in steps (and the seconds it spans) for a job whose saves block ``cost_s`` and
    take ``background_s`` more in the background, failing every ``mtbf_s``, stepping every
    ``step_time_s`` (productive seconds per step, the saves excluded)."""
    if step_time_s <= 0:
        raise ValueError("step_time_s must be positive")
    young = young_daly_interval_s(cost_s, mtbf_s)
    seconds, bound = young, None
    if background_s is not None and seconds < background_s:
        seconds, bound = background_s, "background"
    if seconds < min_s:
        seconds, bound = min_s, "minimum"
    steps = max(1, round(seconds / step_time_s)) if math.isfinite(seconds) else 10_000_000
    steps = min(steps, 10_000_000)
    return IntervalChoice(steps=steps, seconds=round(steps * step_time_s, 3), young_s=round(young, 3), bound=bound)


def changed_enough(old_steps: int | None, new_steps: int, *, tolerance: float = 0.1) -> bool:
    """A new interval is sent (and an event written) only when it moves by more than ``tolerance``:
    each measurement moves the cost a little, and every change makes the ranks agree again."""
    return old_steps is None or abs(new_steps - old_steps) > tolerance * old_steps
