"""POST /v1/simulations: runs the discrete-event model (control_plane/goodput/simulate.py) over the
intervals around Young's, a range of spare counts, and async against sync saves."""

from __future__ import annotations

from dataclasses import replace

from control_plane.errors import Unprocessable
from control_plane.goodput.rules import young_daly_interval_s
from control_plane.goodput.simulate import Scenario, TooManyFailures, closed_form_goodput, mean_outcome, sweep
from control_plane.schemas.simulations import IntervalPoint, ModePoint, SimulationIn, SimulationOut, SparesPoint

MAX_EVENTS = 2_000_000
"""Failures one request may simulate in all (each run costs O(failures))."""
SPARES = (0, 1, 2, 4, 8, 16)


def _best(points: list[tuple[float, float]]) -> tuple[float, float]:
    return max(points, key=lambda p: p[1])


RATE_FIELDS = ("node_mtbf_h", "interruptions", "nodes", "work_h", "recovery_s")
"""The fields that set how often the job fails against how much it must do: a refusal names them."""


def simulate(body: SimulationIn, *, max_events: int = MAX_EVENTS) -> SimulationOut:
    """``max_events``: the budget of simulated failures (tests lower it to try more of the domain)."""
    try:
        return _simulate(body, max_events)
    except TooManyFailures as exc:
        # The estimate below assumes saves finish between failures; one whose interval, costs or
        # spares make it fail again before saving would run for good (and hold a request thread).
        raise _refused(f"this job barely progresses between failures, too slow to simulate here: {exc}",
                       ("interval_s", "blocking_s", "background_s", *RATE_FIELDS)) from exc


def _refused(detail: str, fields: tuple[str, ...]) -> Unprocessable:
    # A 422 names its fields (as a validation error does), though no one of them alone is wrong.
    return Unprocessable(detail, errors=[{"field": f, "message": detail, "type": "too_slow_to_simulate"}
                                         for f in fields])


def _simulate(body: SimulationIn, max_events: int) -> SimulationOut:
    mtbf_h = body.mtbf_h
    base = Scenario(nodes=body.nodes, node_mtbf_h=mtbf_h, work_h=body.work_h, interval_s=body.interval_s or 1.0,
                    blocking_s=body.blocking_s, background_s=body.background_s, recovery_s=body.recovery_s,
                    spares=body.spares, repair_h=body.repair_h, seed=body.seed)
    failures = body.work_h * 3600 / base.job_mtbf_s
    batches = 11 + len(SPARES) + 2 * 11 + 1
    base = replace(base, max_failures=max(int(max_events / (body.runs * batches)), 1))
    if failures * 1.5 * body.runs * batches > max_events or base.job_mtbf_s < body.recovery_s:
        raise _refused(
            f"about {failures:.0f} failures per run (job MTBF {base.job_mtbf_s:.0f}s over {body.work_h:g}h of work, "
            f"recovery {body.recovery_s:g}s): too many to simulate here, or a job that fails faster than it recovers",
            RATE_FIELDS)
    young = young_daly_interval_s(body.blocking_s, base.job_mtbf_s) or 1.0
    points = sweep(replace(base, interval_s=young), body.runs)
    best_interval, _ = _best(points)
    chosen = replace(base, interval_s=body.interval_s or best_interval)
    outcome = mean_outcome(chosen, body.runs)
    closed = None
    if body.background_s == 0 and body.spares is None:
        closed = closed_form_goodput(chosen.interval_s, body.blocking_s, base.job_mtbf_s, body.recovery_s)
    spares = []
    for n in (*SPARES, None):
        o = mean_outcome(replace(chosen, spares=n), body.runs)
        spares.append(SparesPoint(spares=n, goodput=round(o.goodput, 4), waiting_h=round(o.waiting_s / 3600, 3)))
    sync_blocking = body.sync_blocking_s if body.sync_blocking_s is not None else body.blocking_s + body.background_s
    modes = []
    for mode, blocking, background in (("async", body.blocking_s, body.background_s), ("sync", sync_blocking, 0.0)):
        scenario = replace(chosen, blocking_s=blocking, background_s=background,
                           interval_s=young_daly_interval_s(blocking, base.job_mtbf_s) or 1.0)
        interval, goodput = _best(sweep(scenario, body.runs))
        modes.append(ModePoint(mode=mode, blocking_s=blocking, background_s=background, interval_s=interval,
                               goodput=round(goodput, 4)))
    return SimulationOut(
        node_mtbf_h=round(mtbf_h, 3), job_mtbf_s=round(base.job_mtbf_s, 1), young_interval_s=round(young, 1),
        interval_s=round(chosen.interval_s, 1), best_interval_s=best_interval, goodput=round(outcome.goodput, 4),
        goodput_closed_form=None if closed is None else round(closed, 4), wall_h=round(outcome.wall_s / 3600, 3),
        lost_work_h=round(outcome.lost_s / 3600, 3), checkpoint_stall_h=round(outcome.stall_s / 3600, 3),
        recovery_h=round(outcome.recovery_s / 3600, 3), waiting_h=round(outcome.waiting_s / 3600, 3),
        failures=outcome.failures, saves=outcome.saves,
        intervals=[IntervalPoint(interval_s=i, goodput=round(g, 4)) for i, g in points],
        spares=spares, modes=modes,
    )
