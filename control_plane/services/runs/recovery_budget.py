"""A recovery as a budget: split the time from a failure to the new attempt's first step into its
phases, and name the phases that went over their budgets. Pure (standard library only): the job
view, the Prometheus histogram and the over-budget event all call it (docs/architecture.md,
"Recovery phases").

The boundaries, all on the control plane's clock (an agent's instants arrive as ages by its own
monotonic clock, so a node's skewed wall clock moves none of them):

    failure -> failed -> created -> received -> running -> initialised -> first step
     detection  decision  wake_up  process_start  rendezvous  restore

A boundary not measured (an agent or a worker runtime that does not report it) leaves its phase
null and its time counts in the next phase that is measured; a boundary earlier than the one
before it (two reports that raced) is taken as equal to it. So the phases that are not null are
never negative, come in order, and add up to the total exactly (in milliseconds)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

PHASES = ("detection", "decision", "wake_up", "process_start", "rendezvous", "restore")
"""In order; each ends at the boundary of the same index in ``Marks.ends``."""

DESCRIPTIONS = {
    "detection": "failure -> the control plane failed the attempt",
    "decision": "failed -> the new attempt created (its gang placed)",
    "wake_up": "created -> every node's agent has its part",
    "process_start": "received -> every worker process running",
    "rendezvous": "running -> every rank's process group initialised (the script's imports, then init)",
    "restore": "initialised -> the first step reported (the checkpoint loaded, one step)",
}


@dataclass(frozen=True, kw_only=True)
class Marks:
    """The instants of one recovery (aware datetimes; None: not measured, or not yet)."""

    failure: datetime
    """The first evidence of the failure (a worker's exit, or the decision itself)."""
    failed: datetime | None
    created: datetime | None
    received: datetime | None
    """The last node's agent received its part."""
    running: datetime | None
    initialised: datetime | None
    """The last node's ranks all initialised their process group."""
    first_step: datetime | None

    @property
    def ends(self) -> tuple[datetime | None, ...]:
        return (self.failed, self.created, self.received, self.running, self.initialised, self.first_step)


@dataclass(frozen=True)
class Split:
    phases: dict[str, float | None]
    """Phase -> seconds (PHASES order); None: not measured, or not reached yet."""
    total_s: float | None
    """Failure -> first step; None until the first step."""


def split(marks: Marks) -> Split:
    """The phases of ``marks`` (see the module docstring for the rules)."""
    last_ms = 0
    phases: dict[str, float | None] = {}
    for name, end in zip(PHASES, marks.ends, strict=True):
        if end is None:
            phases[name] = None
            continue
        at_ms = max(last_ms, round((end - marks.failure).total_seconds() * 1000))
        phases[name] = (at_ms - last_ms) / 1000
        last_ms = at_ms
    total = last_ms / 1000 if marks.first_step is not None else None
    return Split(phases=phases, total_s=total)


@dataclass(frozen=True)
class Overrun:
    phase: str
    seconds: float
    budget_s: float


def over_budget(phases: Mapping[str, float | None], budgets: Mapping[str, float | None]) -> list[Overrun]:
    """The phases longer than their budget (PHASES order); a phase without a budget, or not
    measured, never is."""
    out = []
    for name in PHASES:
        seconds, budget = phases.get(name), budgets.get(name)
        if seconds is not None and budget is not None and seconds > budget:
            out.append(Overrun(name, seconds, budget))
    return out


def budgets_for(cluster: Mapping[str, float | None], job: Mapping[str, float | None] | None) -> dict[str, float | None]:
    """The budgets of a job: its own (``watchdog.recovery_budget_s``) over the cluster's."""
    own = job or {}
    return {name: own[name] if own.get(name) is not None else cluster.get(name) for name in PHASES}


def describe(overruns: Sequence[Overrun], total_s: float | None) -> str:
    """One line for the event: every phase over budget, with its numbers."""
    parts = [f"{o.phase} took {o.seconds:.3f}s (budget {o.budget_s:g}s)" for o in overruns]
    total = f" of {total_s:.3f}s in all" if total_s is not None else ""
    return f"recovery over budget: {'; '.join(parts)}{total}"
