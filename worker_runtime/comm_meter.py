"""Per-step split of a training step into compute and communication, and the bytes it passed to
collectives: what a worker reports under the METRIC_* names of trainyard/protocol/layout.py.

The layout (worker_runtime/layouts.py) wraps every collective the training step issues: DDP's
bucket all-reduces (a comm hook), FSDP2's all-gathers and reduce-scatters (custom comms) and
HSDP's all-reduce across replicas (FSDP2's all-reduce hook). Each collective is an interval with a
start and an end marker and the bytes of the buffer it works on (an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input: the payload that the ring factor of the planner,
2(n-1)/n or (n-1)/n, multiplies).

Markers are ``time.perf_counter()`` on CPU and CUDA events on GPU (the collectives run on their
own streams there, so host clocks would time only the launch).

What "exposed" means, i.e. the time the step waited for communication rather than computing:

- CPU, a collective the caller blocks on (FSDP2's, gloo runs them synchronously): all of it.
- CPU, DDP's asynchronous bucket all-reduces: they overlap the rest of the backward pass; the
  training thread waits only from the launch of the last bucket of a backward (autograd has no
  more gradients to compute) until the last bucket completes: that tail is exposed.
- GPU: the time collectives ran on their streams (their union within the step). The compute
  stream may have overlapped part of it, so on GPU ``comm_s`` is an upper bound of the exposed
  time; ``comm_busy_s`` is the same figure.

``compute_s`` is the rest of the step: ``step_s - comm_s``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Final

import torch

from trainyard.protocol.layout import METRIC_COMM_BYTES, METRIC_COMM_S, METRIC_COMPUTE_S, METRIC_STEP_S

METRIC_COMM_BUSY_S: Final = "comm_busy_s"
"""Seconds per optimizer step during which at least one collective ran, overlapped or not."""

Marker = float | torch.cuda.Event


@dataclass(eq=False)
class Interval:
    """One collective: when it started and ended (markers) and the bytes of its buffer."""

    start: Marker
    nbytes: int
    end: Marker | None = None
    blocking: bool = False
    """The caller waited for it from start to end (all of it is exposed)."""


@dataclass(eq=False)
class _Step:
    start: Marker
    end: Marker | None = None
    intervals: list[Interval] = field(default_factory=list)
    exposed_tail_s: float = 0.0
    """CPU: the exposed tails of the asynchronous collectives (see the module docstring)."""
    pending: list[Interval] = field(default_factory=list)
    """Asynchronous intervals launched since the last sync point."""


@dataclass(frozen=True, kw_only=True)
class StepSplit:
    """One optimizer step, measured."""

    step_s: float
    comm_s: float
    comm_busy_s: float
    comm_bytes: int
    collectives: int = 0

    @property
    def compute_s(self) -> float:
        return max(0.0, self.step_s - self.comm_s)


class CommMeter:
    """Collects the intervals of the steps since the last :meth:`summary` (the reporting window).

    Only collectives inside a step (between :meth:`begin_step` and :meth:`end_step`) count: the
    warm-up pass that settles DDP's buckets, a restore's agreement and the loss average for a
    progress report are not part of a training step.
    """

    def __init__(self, device: torch.device | str = "cpu", *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._clock = clock
        self._lock = threading.Lock()  # DDP's completion callbacks run on the backend's threads
        self._current: _Step | None = None
        self._window: list[_Step] = []

    def mark(self) -> Marker:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._clock()

    # --- steps ---

    def begin_step(self) -> None:
        self._current = _Step(start=self.mark())

    def end_step(self) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        self.sync_point(step)
        step.end = self.mark()
        self._window.append(step)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Time one optimizer step (all its micro-steps and the optimizer)."""
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    # --- collectives ---

    def launched(self, nbytes: int, *, start: Marker | None = None) -> Interval | None:
        """An asynchronous collective started (now, or at ``start``); None outside a step."""
        step = self._current
        if step is None:
            return None
        interval = Interval(start=self.mark() if start is None else start, nbytes=int(nbytes))
        with self._lock:
            step.intervals.append(interval)
            step.pending.append(interval)
        return interval

    def completed(self, interval: Interval | None) -> None:
        """The collective of ``interval`` is done (may be called from another thread)."""
        if interval is not None:
            interval.end = self.mark()

    @contextlib.contextmanager
    def blocking(self, nbytes: int) -> Iterator[None]:
        """Time a collective the caller waits for (on GPU: the stream waits, so do its events)."""
        step = self._current
        start = self.mark()
        try:
            yield
        finally:
            if step is not None:
                interval = Interval(start=start, nbytes=int(nbytes), end=self.mark(), blocking=True)
                with self._lock:
                    step.intervals.append(interval)

    def record(self, start: Marker, nbytes: int) -> None:
        """A blocking collective that ran from ``start`` until now."""
        step = self._current
        if step is not None:
            with self._lock:
                step.intervals.append(Interval(start=start, nbytes=int(nbytes), end=self.mark(), blocking=True))

    def sync_point(self, step: _Step | None = None) -> None:
        """The training thread has just waited for every asynchronous collective it launched (a
        backward that synchronised gradients returned): the tail after the last launch is exposed."""
        step = step or self._current
        if step is None or self.cuda:
            return
        with self._lock:
            pending, step.pending = step.pending, []
        spans = [(i.start, i.end) for i in pending if isinstance(i.start, float) and isinstance(i.end, float)]
        if spans:
            last_launch = max(start for start, _ in spans)
            step.exposed_tail_s += max(0.0, max(end for _, end in spans) - last_launch)

    # --- results ---

    def splits(self) -> list[StepSplit]:
        """The steps of the window, measured, and the window emptied (on GPU this waits for the
        events of those steps)."""
        window, self._window = self._window, []
        return [self._split(step) for step in window]

    def summary(self) -> dict[str, float]:
        """Means over the window's steps under the METRIC_* names; empty when no step ended."""
        splits = self.splits()
        if not splits:
            return {}
        n = len(splits)
        return {
            METRIC_STEP_S: sum(s.step_s for s in splits) / n,
            METRIC_COMPUTE_S: sum(s.compute_s for s in splits) / n,
            METRIC_COMM_S: sum(s.comm_s for s in splits) / n,
            METRIC_COMM_BUSY_S: sum(s.comm_busy_s for s in splits) / n,
            METRIC_COMM_BYTES: sum(s.comm_bytes for s in splits) / n,
        }

    def _split(self, step: _Step) -> StepSplit:
        assert step.end is not None
        if self.cuda:
            # Every event of the step, on every stream, has completed (elapsed_time needs it); once
            # per reporting window.
            torch.cuda.synchronize()
        step_s = self._seconds(step.start, step.end)
        spans = sorted((self._seconds(step.start, i.start), self._seconds(step.start, i.end))
                       for i in step.intervals if i.end is not None)
        busy, reach = 0.0, 0.0
        for lo, hi in spans:  # the union of the intervals
            lo = max(lo, reach)
            if hi > lo:
                busy += hi - lo
                reach = hi
        if self.cuda:
            exposed = busy
        else:
            exposed = step.exposed_tail_s + sum(
                self._seconds(i.start, i.end) for i in step.intervals if i.blocking and i.end is not None)
        return StepSplit(step_s=step_s, comm_s=min(step_s, exposed), comm_busy_s=min(step_s, busy),
                         comm_bytes=sum(i.nbytes for i in step.intervals), collectives=len(step.intervals))

    @staticmethod
    def _seconds(start: Marker, end: Marker | None) -> float:
        if end is None:
            return 0.0
        if isinstance(start, float) and isinstance(end, float):
            return max(0.0, end - start)
        assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
        return max(0.0, start.elapsed_time(end) / 1000.0)
