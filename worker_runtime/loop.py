"""The bookkeeping of a training loop, owned once: a user's script keeps only its model and step.

    with TrainLoop(total_steps=1000) as loop:          # distributed init, reports, checkpoints
        model = loop.register("model", build_model().to(loop.device))
        optimizer = loop.register("optimizer", torch.optim.AdamW(model.parameters()))
        data = loop.data_loader(dataset, batch_size=32)  # map-style: exact resume for free
        net = loop.ddp(model, example_input)             # DDP when there are several ranks
        for step, (x, y) in loop.steps(data):            # from the restored step to total_steps
            loss = loss_fn(net(x), y)
            optimizer.zero_grad(); loss.backward(); optimizer.step()
            loop.log(loss=loss, lr=optimizer.param_groups[0]["lr"])
        loop.result(accuracy=...)

What it does, in the order of docs/writing-jobs.md: reads the WorkerContext and initialises
torch.distributed; registers the step counter and the RNG streams (per rank) besides what the
script registers; restores the newest good checkpoint before the first step (once everything is
registered); after each step counts the data consumed, saves every ``interval_steps`` (the job's
``checkpoint`` settings), and every ``log_every`` steps reports progress (the loss averaged over
ranks, the metrics, the total) with one small all-reduce that also carries "stop" (a stale attempt
on any rank), so every rank stops at the same step; at the end drains the last upload, reports the
result from rank 0 and prints it as a JSON line. Outside Trainyard (``python train.py`` or a plain
``torchrun``) it runs the same loop without checkpoints, printing progress.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from trainyard.protocol.exits import failed_step_line
from worker_runtime.checkpoint.kept import KeptSave
from worker_runtime.checkpoint.manager import ERROR_DRAIN_S, CheckpointManager
from worker_runtime.context import WorkerContext
from worker_runtime.data import ResumableSampler
from worker_runtime.distributed import (
    device_of,
    init_distributed,
    is_distributed,
    settle_ddp_buckets,
    shutdown_distributed,
)
from worker_runtime.grads import PendingGrads
from worker_runtime.layouts import LayoutError
from worker_runtime.reporting import Reporter, StaleAttemptError
from worker_runtime.state import RngState, Stateful, StepCounter, TrainState
from worker_runtime.streams import INEXACT_EVENT, SeededSamples, StreamWatch, mix, quiet_iter

log = logging.getLogger(__name__)
S = TypeVar("S", bound=Stateful)
TERMINATED = 128 + signal.SIGTERM
"""The exit status after a SIGTERM (the agent stopping the attempt), as a shell reports it."""


class TrainLoop:
    """See the module docstring. ``timeout_s`` bounds rendezvous and every collective (a dead peer
    fails the survivors instead of hanging them); ``log_every`` is how often progress is reported
    (and the loss synchronised). ``ctx`` defaults to the environment."""

    def __init__(self, *, total_steps: int, seed: int = 0, log_every: int = 10, timeout_s: float = 300.0,
                 ctx: WorkerContext | None = None, memory: KeptSave | None = None) -> None:
        if total_steps < 1 or log_every < 1:
            raise ValueError("total_steps and log_every must be >= 1")
        self.total_steps = total_steps
        self.seed = seed
        self.log_every = log_every
        self.timeout_s = timeout_s
        self.ctx = ctx or WorkerContext.from_env()
        self.device = device_of(self.ctx)
        self.state = TrainState()
        self._counter = self.state.register("step", StepCounter())
        self.state.register("rng", RngState(), per_rank=True)
        # Gradients of an accumulation window a save cuts (worker_runtime/grads.py).
        self._grads = self.state.register("grads", PendingGrads(self.state), per_rank=True, optional=True)
        self.reporter = Reporter(self.ctx, echo=not self.ctx.managed, total_steps=total_steps)
        self.checkpoints: CheckpointManager | None = None
        self.restored_step: int | None = None
        self.memory = memory
        """This rank's in-memory copy of its last save (set by worker_runtime.restart.run_restartable)."""
        self.restarts = 0
        """How many times this process restarted in place before this loop (run_restartable)."""
        self._started = False
        self._logged: dict[str, Any] = {}
        self.loss: float | None = None
        """The last loss reported (mean over ranks)."""
        self._result_sent = False
        self._stop = False
        self._wrappers: list[weakref.ref[torch.nn.Module]] = []
        self._previous_sigterm: Any = None
        self._terminate: _Terminate | None = None
        self._step_in_progress: int | None = None
        """The step whose body, save or report runs now (None outside ``steps``): named when it raises."""
        self._generators: dict[int, torch.Generator] = {}
        """The generator of each loader made by ``data_loader`` (by the loader's id), reseeded per epoch."""
        self._watch: StreamWatch | None = None

    # --- setup ---

    def __enter__(self) -> TrainLoop:
        init_distributed(self.ctx, timeout=self.timeout_s)
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._terminate = _Terminate(os.getpid())
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._terminate)
        return self

    @property
    def step(self) -> int:
        """Steps done so far (the restored step after a restore)."""
        return self._counter.value

    @property
    def restored_from(self) -> str | None:
        """``memory`` or ``storage``: where the restored step came from (None: a fresh start)."""
        return self.checkpoints.restored_from if self.checkpoints is not None else None

    @property
    def distributed(self) -> bool:
        return is_distributed()

    def register(self, name: str, obj: S, *, per_rank: bool = False) -> S:
        """Add state a checkpoint saves (the unwrapped model, the optimizer, an LR scheduler, a
        GradScaler...); ``per_rank`` for state that differs between ranks. Before the first step."""
        if self._started:
            raise RuntimeError(f"register {name!r} before the first step: the checkpoint was restored already")
        return self.state.register(name, obj, per_rank=per_rank)

    def data_loader(self, dataset: Dataset[Any], *, batch_size: int, shuffle: bool = True,
                    **kwargs: Any) -> DataLoader[Any]:
        """A DataLoader over a map-style dataset whose position is saved and restored with the
        checkpoint (a :class:`ResumableSampler` registered as ``data``): each rank reads its own
        share of each epoch, in an order drawn from ``(seed, epoch)``. In DataLoader workers
        (``num_workers`` > 0) each sample's random draws come from ``(seed, epoch, index)``
        (worker_runtime.streams.SeededSamples), so augmentation there resumes exactly too."""
        size = len(dataset)  # type: ignore[arg-type]
        sampler = ResumableSampler(size, rank=self.ctx.rank, world_size=self.ctx.world_size,
                                   seed=self.seed, shuffle=shuffle, keyed=True)
        self.register("data", sampler, per_rank=True)
        # The loader's own generator (reseeded per epoch in steps): its iterators draw their base
        # seed there, not from the registered global stream (worker_runtime/streams.py).
        generator = kwargs.pop("generator", None) or torch.Generator()
        loader = DataLoader(SeededSamples(dataset, size, self.seed), batch_size=batch_size, sampler=sampler,
                            drop_last=True, generator=generator, **kwargs)
        self._generators[id(loader)] = generator
        return loader

    def ddp(self, model: torch.nn.Module, *example: torch.Tensor) -> torch.nn.Module:
        """``model`` wrapped in DistributedDataParallel when there are several ranks (itself when
        not). With an ``example`` input, DDP's gradient buckets are settled first, so that a resumed
        run sums gradients in the same order as the uninterrupted one (settle_ddp_buckets).

        Refused (LayoutError, before the first step) when the job asks for a layout that plain DDP
        is not: FSDP2, HSDP, tensor parallel or compressed gradients would otherwise be dropped in
        silence, and the job would train with another memory footprint than the one it was planned
        and admitted for. Such a job applies its layout with ``apply_layout(model, loop.ctx)``."""
        layout = self.ctx.layout
        if layout.kind != "ddp" or layout.compression != "none":
            asked = layout.kind if layout.kind != "ddp" else f"ddp with {layout.compression} compression"
            raise LayoutError(f"the job asks for layout {asked}, and loop.ddp() applies plain DistributedDataParallel: "
                              "apply the job's layout with worker_runtime.apply_layout(model, loop.ctx) "
                              "(docs/writing-jobs.md, 'Layouts')")
        if not is_distributed():
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.ctx.local_rank] if self.ctx.device == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids)
        if example:
            settle_ddp_buckets(wrapped, *(t.to(self.device) for t in example))
        self._wrappers.append(weakref.ref(wrapped))
        return wrapped

    def restore(self) -> int | None:
        """Load the newest good checkpoint of the job's restore plan (None: a fresh start). Done by
        ``steps`` if the script does not call it; everything must be registered by then."""
        if self._started:
            return self.restored_step
        self._started = True
        self._grads.watch()
        self.checkpoints = CheckpointManager(self.ctx, self.state, memory=self.memory)
        self.restored_step = self.checkpoints.restore()
        if self.restored_step is not None and self.ctx.is_main:
            print(f"trainyard: restored step {self.restored_step}; resuming at step {self.restored_step + 1}",
                  file=sys.stderr, flush=True)
        return self.restored_step

    # --- the loop ---

    def steps(self, data: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """``(step, batch)`` from the step after the restored one up to ``total_steps``, epoch after
        epoch. The code between two yields is one training step; when it is done the loop counts the
        batch as consumed, saves and reports as due, and stops early (every rank at the same step)
        when the attempt is stale."""
        self.restore()
        sampler = getattr(data, "sampler", None)
        resumable = sampler if isinstance(sampler, ResumableSampler) else None
        if resumable is None and self.ctx.is_main:
            log.warning("the data is not a TrainLoop.data_loader: its position is not saved, so a resumed run "
                        "reads other samples than the uninterrupted one would have")
        batch_size = int(getattr(data, "batch_size", 1) or 1)
        first = self.step + 1
        generator = self._generators.get(id(data))
        # Rank 0 alone looks (every rank runs the same code) and warns at the first save.
        self._watch = _watch([self.state[n] for n in self.state.names()], data,
                             owned_loader=generator is not None, device=self.ctx.device,
                             owned=[generator] if generator is not None else []) if self.ctx.is_main else None
        while self.step < self.total_steps and not self._stop:
            fed = False
            if generator is not None and resumable is not None:
                generator.manual_seed(mix(self.seed, self.ctx.rank, resumable.epoch))
            self._step_in_progress = self.step + 1  # reading its batch may raise too
            for batch in _Epoch(data):
                fed = True
                step = self.step + 1
                yield step, batch
                self._counter.value = step
                if resumable is not None:
                    resumable.advance(batch_size)
                self._after(step, first)
                self._step_in_progress = step + 1
                if self._terminate is not None and self._terminate.received:
                    # Its SystemExit was raised where it could be swallowed (a finalizer run by
                    # the garbage collector prints "Exception ignored" and goes on): stop here.
                    raise SystemExit(TERMINATED)
                if self._stop or step >= self.total_steps:
                    self._step_in_progress = None
                    return
            # A position restored at the end of an epoch (a save after its last batch) yields nothing
            # more of that epoch: go on with the next one, as the uninterrupted run did.
            if not fed and (resumable is None or resumable.consumed == 0):
                raise ValueError("the data yields no batch: is the dataset smaller than one batch per rank?")
            if resumable is not None:
                resumable.next_epoch()
        self._step_in_progress = None

    def log(self, loss: float | torch.Tensor | None = None, **metrics: float | torch.Tensor) -> None:
        """This step's loss and metrics (tensors are fine: they are read only when reported)."""
        self._logged = {"loss": loss, **metrics}

    def _after(self, step: int, first: int) -> None:
        if self.checkpoints is not None and self.checkpoints.should_save(step):
            self.checkpoints.save(step)
            self._warn_inexact()
        if step in (first, self.total_steps) or step % self.log_every == 0:
            loss = self._logged.get("loss")
            mean, self._stop = self._mean_and_stop(loss)
            metrics = {k: _number(v) for k, v in self._logged.items() if k != "loss" and v is not None}
            self.loss = mean
            self.reporter.progress(step, loss=mean, **{k: v for k, v in metrics.items() if v is not None})

    def _warn_inexact(self) -> None:
        """At the first save: name each cause a resume of this run cannot be exact (an event, which
        ``trainyard describe`` shows), before the user finds out from the loss."""
        watch, self._watch = self._watch, None
        if watch is None or not self.ctx.is_main or self.checkpoints is None:
            return
        try:
            causes = watch.causes()
        except Exception:  # a warning must never stop training
            log.exception("could not check what this run's checkpoints miss")
            return
        for cause in causes:
            log.warning("resume will not be exact: %s", cause.message)
            self.checkpoints.reporter.event(INEXACT_EVENT, cause.message, {"cause": cause.kind, "what": cause.what})

    def _mean_and_stop(self, loss: Any) -> tuple[float | None, bool]:
        """The loss averaged over ranks, and whether any rank must stop: one small all-reduce."""
        value = _number(loss)
        packed = torch.tensor([value if value is not None else 0.0, float(self.reporter.stale)],
                              dtype=torch.float64, device=self.device)
        if is_distributed():
            dist.all_reduce(packed)
            packed[0] /= self.ctx.world_size
        return (float(packed[0]) if value is not None else None), bool(packed[1] > 0)

    # --- the end ---

    def result(self, values: dict[str, Any] | None = None, **more: Any) -> None:
        """The job's result (rank 0's counts): printed as one JSON line and reported. Without a
        call, the loop reports ``{steps, final_loss}`` when it ends."""
        if self._stop:
            return  # a stale attempt: its result is not the job's
        payload = {"steps": self.step, "final_loss": self.loss, **(values or {}), **more}
        payload = {k: _number(v) if isinstance(v, torch.Tensor) else v for k, v in payload.items()}
        self._result_sent = True
        if not self.ctx.is_main:
            return
        print(json.dumps(payload, sort_keys=True, default=str), flush=True)
        try:
            self.reporter.result(payload)
        except StaleAttemptError as exc:
            print(f"trainyard: {exc}; this attempt's result is dropped", file=sys.stderr)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, Exception) and self._step_in_progress is not None:
            # Printed before the traceback (the exception leaves the script after this): the rank
            # shim's classification adds the step to the failure's message, and the control plane
            # stops retrying an exception that comes back at the same step (docs/writing-jobs.md).
            # One write, newline included: another thread's line must not land inside it.
            sys.stderr.write(failed_step_line(self._step_in_progress, exc) + "\n")
            sys.stderr.flush()
        try:
            if self.checkpoints is not None:
                # Drains the upload in flight: the last checkpoint is reported before the result.
                self.checkpoints.close(timeout=None if kind is None else ERROR_DRAIN_S)
            if kind is None and not self._result_sent and not self._stop and self.step >= self.total_steps:
                self.result()
            self.reporter.close()
        finally:
            if self._previous_sigterm is not None and not (self._terminate and self._terminate.received):
                # After a SIGTERM, later ones stay ignored to the end of the process (_Terminate).
                signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._shutdown()

    def _shutdown(self) -> None:
        # A DDP reducer destroyed after its process group can hang the exit: destroy the group only
        # once every wrapper made here is gone (the script's own references included).
        gc.collect()
        if any(ref() is not None for ref in self._wrappers):
            log.debug("DDP wrappers still referenced; the process group is left to the process exit")
            return
        shutdown_distributed()


def _watch(registered: list[Any], data: Iterable[Any], **kwargs: Any) -> StreamWatch | None:
    try:
        return StreamWatch(registered, data, **kwargs)
    except Exception:  # a warning must never stop training
        log.exception("could not look for state this run's checkpoints miss")
        return None


class _Epoch:
    """One pass over ``data``: its iterator is created without drawing from the global torch stream
    (worker_runtime.streams.quiet_iter)."""

    def __init__(self, data: Iterable[Any]) -> None:
        self._data = data

    def __iter__(self) -> Iterator[Any]:
        return quiet_iter(self._data)


class _Terminate:
    """The SIGTERM handler while a loop runs. The agent stops an attempt with SIGTERM (then SIGKILL
    after a grace period): unwind through the loop's __exit__ (drain the upload in flight, flush
    progress) and exit with TERMINATED, as a shell would.

    Once only: the agent signals every process of the attempt, and torchrun and the rank shim
    forward theirs, so a worker gets two or three SIGTERMs. A second SystemExit raised in the
    middle of the unwinding (inside a join, a finalizer, an atexit hook) would abort the drain and
    print "Exception ignored ... SystemExit: 143" tracebacks into the job's log; so after the first
    one SIGTERM is ignored to the end of the process (SIGKILL stays the agent's last word), and so
    are the deaths of DataLoader workers. A process forked from the worker that kept this handler
    has no loop to unwind: it just exits."""

    def __init__(self, owner_pid: int) -> None:
        self.owner_pid = owner_pid
        self.received = False

    def __call__(self, signum: int, frame: Any) -> None:
        if os.getpid() != self.owner_pid:
            os._exit(TERMINATED)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # The agent stops the DataLoader's worker processes too (they die of it: torch's own
        # handler), and torch's SIGCHLD handler would raise "DataLoader worker is killed by
        # signal" in the middle of the unwinding: their end is expected now.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.received = True
        raise SystemExit(TERMINATED)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    try:
        number = float(value.detach().float().item() if isinstance(value, torch.Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        return None
    return number if math.isfinite(number) else None
