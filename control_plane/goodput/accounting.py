"""A job's GPU-time split into what it bought, from recorded facts (docs/goodput.md, "Accounting").

Each attempt is an interval of held GPUs (its leases). Its time is cut at recorded instants:

    allocated -> first step        startup (the first attempt) or recovery (after a failure)
    first step -> last step        productive, less the checkpoint stalls its ranks reported,
                                   less the steps a later attempt computed again (lost work)
    last step -> failure           hung (failed as hung), else lost work (the step in progress)
    failure -> GPUs released       recovery (detection, stopping)
    anything else                  other (the final save and teardown, a cancel)

Lost work: when attempt n+1 restores step r, every step above r computed before is recomputed;
it moves from productive to lost at the step time of the attempt that computed it. Queueing (submit
-> first allocation) holds no GPUs: it is shown beside the allocated time, not inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime


@dataclass(frozen=True, kw_only=True)
class AttemptFacts:
    number: int
    gpus: int
    allocated_at: datetime
    leases_gpu_s: float
    """GPU-seconds its leases were held (now for those still held)."""
    released_at: datetime | None
    """When its last lease was released; None while any is held."""
    start_step: int = 0
    """The step it restored (0: from scratch)."""
    first_step_at: datetime | None = None
    last_step_at: datetime | None = None
    last_step: int | None = None
    failed: bool = False
    failure_at: datetime | None = None
    """First evidence of its failure (a worker's exit, or the decision)."""
    hung_since: datetime | None = None
    stall_s: float = 0.0
    """Seconds its loop was blocked by checkpoint saves (each save's slowest rank)."""


@dataclass(frozen=True, kw_only=True)
class JobFacts:
    created_at: datetime
    gpus: int
    attempts: list[AttemptFacts]
    now: datetime


@dataclass
class Breakdown:
    allocated_gpu_s: float = 0.0
    productive_gpu_s: float = 0.0
    checkpoint_stall_gpu_s: float = 0.0
    lost_work_gpu_s: float = 0.0
    recovery_gpu_s: float = 0.0
    hung_gpu_s: float = 0.0
    startup_gpu_s: float = 0.0
    other_gpu_s: float = 0.0
    queueing_gpu_s: float = 0.0
    steps_productive: int = 0
    steps_lost: int = 0
    recoveries: int = 0
    recovery_downtime_s: float = 0.0
    """Wall seconds from each failure to the next attempt's first step (the queue included)."""
    hung_s: float = 0.0
    queued_s: float = 0.0
    components: tuple[str, ...] = field(default=(
        "productive", "checkpoint_stall", "lost_work", "recovery", "hung", "startup", "other"), repr=False)

    @property
    def goodput(self) -> float | None:
        return round(self.productive_gpu_s / self.allocated_gpu_s, 4) if self.allocated_gpu_s > 0 else None

    def add(self, other: Breakdown) -> None:
        for name in ("allocated_gpu_s", "productive_gpu_s", "checkpoint_stall_gpu_s", "lost_work_gpu_s",
                     "recovery_gpu_s", "hung_gpu_s", "startup_gpu_s", "other_gpu_s", "queueing_gpu_s",
                     "steps_productive", "steps_lost", "recoveries", "recovery_downtime_s", "hung_s", "queued_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def _s(a: datetime | None, b: datetime | None) -> float:
    return max((b - a).total_seconds(), 0.0) if a is not None and b is not None else 0.0


@dataclass
class _Segment:
    attempt: int
    low: int
    high: int
    step_s: float


def account(job: JobFacts) -> Breakdown:
    """The job's breakdown (GPU-seconds; wall seconds where named so)."""
    out = Breakdown()
    attempts = sorted(job.attempts, key=lambda a: a.number)
    out.queued_s = _s(job.created_at, attempts[0].allocated_at if attempts else job.now)
    out.queueing_gpu_s = out.queued_s * job.gpus
    segments: list[_Segment] = []
    lost_s = 0.0
    previous: AttemptFacts | None = None
    for a in attempts:
        g = a.gpus
        out.allocated_gpu_s += a.leases_gpu_s
        if segments or previous is not None:
            # Every step above the one this attempt starts from is computed again.
            for seg in segments:
                if seg.high > a.start_step:
                    redo = seg.high - max(seg.low, a.start_step)
                    out.steps_lost += redo
                    lost_s += redo * seg.step_s * g
                    seg.high = max(seg.low, a.start_step)
        ramp = _s(a.allocated_at, a.first_step_at if a.first_step_at else (a.failure_at or job.now))
        after_failure = previous is not None and previous.failed
        if after_failure:
            out.recovery_gpu_s += ramp * g
            out.recoveries += 1
            assert previous is not None
            if a.first_step_at is not None:
                out.recovery_downtime_s += _s(previous.failure_at, a.first_step_at)
        else:
            out.startup_gpu_s += ramp * g
        window = _s(a.first_step_at, a.last_step_at)
        stall = min(a.stall_s, window)
        out.checkpoint_stall_gpu_s += stall * g
        steps = max((a.last_step or a.start_step) - a.start_step, 0)
        if steps > 0:
            segments.append(_Segment(a.number, a.start_step, a.start_step + steps, (window - stall) / steps))
        if a.failed:
            end = a.released_at or job.now
            if a.hung_since is not None:
                out.hung_s += _s(a.hung_since, a.failure_at)
                out.hung_gpu_s += _s(a.hung_since, a.failure_at) * g
            elif a.last_step_at is not None:
                lost_s += _s(a.last_step_at, a.failure_at) * g  # the step in progress
            out.recovery_gpu_s += _s(a.failure_at, end) * g
        previous = a
    out.lost_work_gpu_s = lost_s
    kept = sum(seg.high - seg.low for seg in segments)
    out.steps_productive = kept
    out.productive_gpu_s = sum((seg.high - seg.low) * seg.step_s for seg in segments) * job.gpus
    counted = (out.productive_gpu_s + out.checkpoint_stall_gpu_s + out.lost_work_gpu_s + out.recovery_gpu_s
               + out.hung_gpu_s + out.startup_gpu_s)
    out.other_gpu_s = max(out.allocated_gpu_s - counted, 0.0)
    return out
