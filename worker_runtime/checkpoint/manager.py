"""The worker's side of two-phase checkpoints: save this rank's shard, restore from a plan.

Saving (phase 1 of docs/architecture.md, "Two-phase checkpoints"): every rank copies its whole
:class:`TrainState` into host memory (the consistency point: the loop is paused for exactly that
long; checkpoint/snapshot.py), then a single background thread serialises it with ``torch.save``,
hashes it, uploads it to

    <prefix>/step-<step:09d>/attempt-<attempt:04d>/rank-<rank:05d>.pt   (trainyard.protocol.keys)

and reports it to the agent (LocalShard), with what the save cost: the seconds the loop was blocked
and the seconds the background part took (goodput accounting, the auto interval). The control plane
commits the checkpoint once every rank has reported (phase 2). At most one save is in flight: a
save that finds the previous upload still running waits for it (``when_busy: "wait"``) or, with
``"skip"``, is skipped on every rank (a ``checkpoint.skipped`` event). A failed upload never stops
training: it is logged and reported as ``checkpoint.save_failed``, and the control plane aborts
that step.

Interval ``"auto"`` (docs/goodput.md): the platform chooses the interval; the attempt starts with
the one in its launch spec, and at each save rank 0 asks its agent for the current one. Ranks must
save at the same steps, so they agree at each save, in one small all-reduce (with whether any
rank's previous upload is still running, for ``"skip"``), on rank 0's interval and the next step
to save at. A job with a fixed interval and ``"wait"`` needs no collective.

Before uploading, the background thread waits for an upload slot (slots.py; docs/architecture.md,
"Checkpoint upload slots") and then uploads at the slot's byte rate (pacing.py). Training never
waits for a slot: a save that finds the previous one still waiting for its slot (or paced) ends
that wait, and the previous upload goes at once, unpaced, so the loop waits no longer than it
waited before slots existed (for the upload itself). The wait and the upload's duration go with the
shard report and are shown per checkpoint by ``GET /v1/jobs/{id}/checkpoints``.

What a shard holds (``TrainState.shard_state_dict``): rank 0's holds everything registered
(model, optimizer, scheduler, scaler, data position, RNG, step, ...); another rank's holds only
what differs between ranks: its per-rank state (data position, RNG) and sharded state. Under DDP
the replicated model and optimizer are therefore written once, not once per rank, and a restoring
rank reads them from rank 0's shard (verified like its own). Sharded state (FSDP2 / DTensor state
dicts) is in every rank's shard: ``torch.save`` of a DTensor stores the rank's *local* shard plus
its placement, so each rank's file holds only its own part and must be restored by the same rank
of the same world size (checked: the manifest's world size must match).

Restoring: see :mod:`worker_runtime.checkpoint.restore` for how ranks verify and agree.
"""

from __future__ import annotations

import hashlib
import io
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainyard.protocol.agent import CHECKPOINT_AUTO_FIRST_STEPS
from trainyard.protocol.keys import job_checkpoint_prefix, shard_key
from trainyard.protocol.storage import CheckpointStorage, ObjectInfo, PacedStorage
from trainyard.storage.pacing import Pacer
from worker_runtime.checkpoint.kept import KeptSave
from worker_runtime.checkpoint.memtier import AgentMemory
from worker_runtime.checkpoint.notify import (
    FALLBACK,
    RESTORE_FAILED,
    RESTORED,
    SAVE_FAILED,
    SKIPPED,
    UPLOAD_UNSLOTTED,
    CheckpointReporter,
    ShardSink,
)
from worker_runtime.checkpoint.presigned import AgentGrants, PresignedStorage
from worker_runtime.checkpoint.restore import (
    TIER_CODES,
    Fetched,
    Problem,
    agree,
    candidates_of,
    describe,
    fetch_shard,
    is_bad,
    resolve,
)
from worker_runtime.checkpoint.slots import SlotGrant, UploadSlots
from worker_runtime.checkpoint.snapshot import host_copy
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import device_of
from worker_runtime.state import TrainState

log = logging.getLogger(__name__)
_STORAGE_VARS = "TRAINYARD_STORAGE_ACCESS or TRAINYARD_S3_*"


ERROR_DRAIN_S = 5.0
"""How long a manager left on an error waits for the upload in flight (then it stops waiting)."""

class CheckpointUnavailableError(RuntimeError):
    """There is a restore plan but its storage cannot be reached (starting fresh would waste the
    job's progress; failing the attempt lets the control plane retry later)."""


class StaleSlotError(RuntimeError):
    """The control plane refused this attempt an upload slot: it is stale."""


class CheckpointLoadError(RuntimeError):
    """A verified shard did not load into the TrainState on some rank; the state is undefined."""


@dataclass(frozen=True, kw_only=True)
class SaveRecord:
    """What one save did on this rank (``CheckpointManager.saves``)."""

    step: int
    key: str
    ok: bool
    size_bytes: int = 0
    sha256: str = ""
    blocked_s: float = 0.0
    """Time the loop waited for the previous upload before this save could start."""
    snapshot_s: float = 0.0
    """Time the loop was paused serialising the state (the synchronous part)."""
    upload_s: float = 0.0
    """Serialising (an asynchronous save's copy), hashing and uploading, in the background; the
    slot wait not included."""
    put_s: float = 0.0
    """The storage put alone (upload throughput: size_bytes / put_s)."""
    slot_wait_s: float = 0.0
    """Time the background thread waited for an upload slot."""
    slot: str = "none"
    """How the shard was uploaded: granted (within a slot), bypassed (without one), none (no slot service)."""
    reported: bool = False
    error: str | None = None

    @property
    def blocking_s(self) -> float:
        """What this save cost the training loop."""
        return self.blocked_s + self.snapshot_s


def storage_from_context(ctx: WorkerContext, *, timeout_s: float = 10.0, retries: int = 1) -> CheckpointStorage | None:
    """The worker's checkpoint storage, or None when it has none.

    Under an agent (TRAINYARD_STORAGE_ACCESS=presigned): presigned URLs per object, obtained through
    the agent; the worker holds no credential. Outside Trainyard: S3 from the script's own
    TRAINYARD_S3_* variables. Short timeouts and one retry: a dead S3 must cost a save seconds, not
    minutes.
    """
    if ctx.storage.get("access") == "presigned" and ctx.agent_url:

        source = AgentGrants(agent_url=ctx.agent_url, attempt_id=ctx.attempt_id, fencing_token=ctx.fencing_token,
                             rank=ctx.rank, agent_socket=ctx.agent_socket)
        return PresignedStorage(source, timeout_s=timeout_s, retries=retries,
                                ca_file=ctx.storage.get("ca_file"), ca_pem=ctx.storage.get("ca_pem"))
    if not (ctx.storage.get("endpoint") and ctx.storage.get("bucket")):
        return None
    from trainyard.storage.s3 import S3Config, S3Storage  # deferred: a worker given presigned grants never loads minio

    return S3Storage(S3Config.from_mapping(dict(ctx.storage)), timeout_s=timeout_s, retries=retries)


class CheckpointManager:
    """Saves and restores one rank's :class:`TrainState`; a no-op without interval or storage.

    ``interval_steps`` and ``storage`` default to the job's settings (``ctx.checkpoint``) and the
    worker's storage (storage_from_context); ``reporter`` to the agent of ``ctx``. ``async_upload=False`` makes
    ``save`` return only after the upload and report. ``upload_delay_s`` sleeps between upload and
    report (tests use it to kill a worker mid-checkpoint). ``slots`` defaults to the agent of
    ``ctx`` (slots.py). ``agent_memory``: the in-memory tier (True: through the agent of ``ctx``
    when it keeps one; False or None: S3 only).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        state: TrainState,
        *,
        storage: CheckpointStorage | None = None,
        interval_steps: int | None = None,
        reporter: ShardSink | None = None,
        async_upload: bool = True,
        upload_delay_s: float = 0.0,
        slots: UploadSlots | None = None,
        memory: KeptSave | None = None,
        agent_memory: AgentMemory | None | bool = True,
    ) -> None:
        interval = interval_steps if interval_steps is not None else ctx.checkpoint.get("interval_steps")
        self.auto = interval == AUTO
        if self.auto:
            interval = ctx.checkpoint.get("auto_interval_steps") or CHECKPOINT_AUTO_FIRST_STEPS
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
            raise ValueError(f"interval_steps must be a positive integer, 'auto' or None, got {interval!r}")
        self.when_busy = str(ctx.checkpoint.get("when_busy") or "wait")
        if self.when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', got {self.when_busy!r}")
        self.ctx = ctx
        self.state = state
        self.interval_steps: int | None = interval
        self.next_save: int | None = interval if self.auto else None
        """With 'auto': the step the ranks agreed to save at next."""
        self.storage = storage if storage is not None else storage_from_context(ctx)
        self.reporter: ShardSink = reporter if reporter is not None else CheckpointReporter(ctx)
        self.prefix = (ctx.checkpoint_prefix or job_checkpoint_prefix(ctx.job_id)).strip("/")
        self._async = async_upload
        self._upload_delay_s = upload_delay_s
        self.slots = slots if slots is not None else UploadSlots(ctx)
        self.agent_memory: AgentMemory | None = (AgentMemory.of(ctx) if agent_memory is True else agent_memory or None)
        """The in-memory checkpoint tier through the agent (checkpoint/memtier.py); None: off."""
        self.restored_tiers: dict[str, list[int]] = {}
        """After a restore: which ranks each tier (local, peer, s3) served."""
        self._hurry = threading.Event()  # set by a save that finds the previous upload still waiting
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[SaveRecord] | None = None
        self._closed = False
        self._closing = False  # a close gave up waiting: releases go on the (joined) upload thread
        self.memory = memory
        """Keeps a host copy of each save for an in-process restart (worker_runtime/restart.py)."""
        self.restored_from: str | None = None
        """``memory`` or ``storage`` once restore found a checkpoint."""
        self.saves: deque[SaveRecord] = deque(maxlen=1000)
        """Every save of this process, oldest first."""
        if not self.enabled and ctx.is_main:
            why = "no interval_steps" if interval is None else f"no checkpoint storage ({_STORAGE_VARS})"
            log.info("checkpoints disabled: %s", why)

    @property
    def enabled(self) -> bool:
        """True when this manager saves (an interval and a storage are both set)."""
        return self.interval_steps is not None and self.storage is not None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        # Leaving on an error (a peer failed: the gang is broken), the upload in flight gets
        # ERROR_DRAIN_S, not forever: the process has to exit, or to ask its agent for the next
        # attempt within the handover wait (worker_runtime.restart), as TrainLoop's exit does.
        self.close(timeout=None if kind is None else ERROR_DRAIN_S)

    def should_save(self, step: int) -> bool:
        if not self.enabled or step <= 0:
            return False
        if self.next_save is not None:
            return step >= self.next_save
        return step % (self.interval_steps or 1) == 0

    def shard_key(self, step: int) -> str:
        return shard_key(self.prefix, step, self.ctx.attempt_number, self.ctx.rank)

    # --- saving ---

    def save(self, step: int) -> bool:
        """Snapshot the state now and upload it in the background; False if disabled, stale or skipped.

        Call it on every rank after the optimizer step of ``step``. It raises only when the state
        cannot be copied (a bug); serialisation, storage and agent failures are reported
        (``checkpoint.save_failed``: that checkpoint is aborted, training goes on), never raised.
        With ``async_upload=False`` the copy is skipped: the state is serialised, uploaded and
        reported before ``save`` returns.
        """
        if not self.enabled or self._closed or getattr(self.reporter, "stale", False):
            return False
        t0 = time.monotonic()
        if self.auto or self.when_busy == "skip":
            busy = self._pending is not None and not self._pending.done()
            asked = self._ask_interval() if self.auto and self.ctx.is_main else None
            busy_anywhere, interval = _agree_max([int(busy), asked or 0], world_size=self.ctx.world_size)
            if self.auto:
                if interval and interval != self.interval_steps:
                    log.info("checkpoint interval %s -> %d steps (set by the platform)", self.interval_steps, interval)
                    self.interval_steps = interval
                self.next_save = step + (self.interval_steps or 1)
            if busy_anywhere and self.when_busy == "skip":
                if self.ctx.is_main:
                    self.reporter.event(SKIPPED, f"checkpoint of step {step} skipped: the previous one is still "
                                        "uploading (when_busy: skip)", {"step": step})
                self.saves.append(SaveRecord(step=step, key=self.shard_key(step), ok=False, error="skipped"))
                return False
        pending = self._pending
        if pending is not None and not pending.done():
            self._hurry.set()  # the loop never waits for a slot or a pace: the upload in flight goes now
        self.wait()
        self._hurry.clear()
        t1 = time.monotonic()
        state = self.state.shard_state_dict(self.ctx.rank)
        payload: io.BytesIO | dict[str, Any]
        if self._async:
            payload = host_copy(state)
        else:
            payload = io.BytesIO()
            torch.save(state, payload)
        if self.memory is not None:
            # The whole state (rank 0's shard already is): a restart from memory needs no other rank.
            whole = payload if isinstance(payload, dict) and self.ctx.rank == 0 else host_copy(self.state.state_dict())
            self.memory.keep(step, attempt_number=self.ctx.attempt_number, rank=self.ctx.rank,
                             world_size=self.ctx.world_size, state=whole)
        timing = (t1 - t0, time.monotonic() - t1)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainyard-checkpoint")
        self._pending = self._executor.submit(self._upload, step, payload, timing)
        if not self._async:
            self.wait()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the save in flight (if any); False if it is still running after ``timeout``."""
        pending = self._pending
        if pending is None:
            return True
        try:
            pending.result(timeout)
        except FutureTimeout:
            return False
        except Exception:  # a custom reporter raised: the save is over either way
            log.exception("checkpoint upload thread failed")
        self._pending = None
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Drain the save in flight and stop the upload thread; idempotent. False if it timed out."""
        drained = self.wait(timeout)
        if not drained:
            self._closing = True
            # The process is leaving: the upload in flight stops waiting for a slot (giving its queue
            # place back) and is no longer paced, so its slot, if any, is released before the exit.
            self._hurry.set()
        if self._executor is not None:
            self._executor.shutdown(wait=drained)
        self._closed = True
        return drained

    def _ask_interval(self) -> int | None:
        ask = getattr(self.reporter, "checkpoint_interval", None)
        return ask() if callable(ask) else None

    def _upload(self, step: int, payload: io.BytesIO | dict[str, Any], timing: tuple[float, float]) -> SaveRecord:
        key = self.shard_key(step)
        blocked_s, snapshot_s = timing
        started = time.monotonic()
        size, digest, put_s = 0, "", 0.0
        grant = SlotGrant(use="none", wait_s=0.0)
        buffer = payload if isinstance(payload, io.BytesIO) else io.BytesIO()
        held = False  # a granted slot not given back yet: the finally below gives it back whatever happens
        try:
            try:
                if not isinstance(payload, io.BytesIO):
                    torch.save(payload, buffer)  # the host copy, while training goes on
                    del payload
                with buffer.getbuffer() as view:
                    size, digest = view.nbytes, hashlib.sha256(view).hexdigest()
                buffer.seek(0)
                grant = self.slots.acquire(step, size, hurry=self._hurry)
                held = grant.use == "granted"
                if grant.stale:
                    if hasattr(self.reporter, "stale"):
                        self.reporter.stale = True  # later saves are skipped, as after a refused report
                    raise StaleSlotError("the attempt is stale: no upload slot, nothing uploaded")
                if grant.use == "bypassed":
                    self.reporter.event(UPLOAD_UNSLOTTED, f"step {step} uploaded without a slot: {grant.reason}"[:4096],
                                        {"step": step, "waited_s": round(grant.wait_s, 3)})
                put_started = time.monotonic()
                info = self._put(step, key, buffer, size, grant)
                put_s = time.monotonic() - put_started
                if info.size != size:
                    raise OSError(f"storage holds {info.size} bytes under {key}, {size} were sent")
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                upload_s = time.monotonic() - started - grant.wait_s
                held = False
                self._release(step, grant, ok=False, size=0, upload_s=put_s)
                if not grant.stale:
                    log.error("checkpoint of step %d not saved (upload of %s failed: %s); training continues",
                              step, key, error)
                    self.reporter.event(SAVE_FAILED, f"upload of {key} failed: {error}"[:4096], {"step": step})
                record = SaveRecord(step=step, key=key, ok=False, size_bytes=size, sha256=digest,
                                    blocked_s=blocked_s, snapshot_s=snapshot_s, upload_s=upload_s, put_s=put_s,
                                    slot_wait_s=grant.wait_s, slot=grant.use, error=error)
            else:
                upload_s = time.monotonic() - started - grant.wait_s
                if self._upload_delay_s > 0:
                    time.sleep(self._upload_delay_s)
                stats = {"wait_s": round(grant.wait_s, 6), "upload_s": round(put_s, 6), "slot": grant.use}
                # A synchronous save blocked the loop for its upload (and its slot wait) too.
                blocking = blocked_s + snapshot_s + (0.0 if self._async else upload_s + grant.wait_s)
                if self.agent_memory is not None:
                    # Before the report, so that a committed checkpoint's shards are in their agents'
                    # memory (and their peers', which the agent waits for, bounded) when it commits.
                    # getvalue() shares the buffer's bytes (no copy) while nothing else holds a view of it.
                    self.agent_memory.put(self.ctx.rank, digest, buffer.getvalue())
                # The background part includes the slot wait: the auto interval must leave room for it.
                reported = self.reporter.shard(step=step, key=key, size_bytes=size, sha256=digest, upload=stats,
                                               blocking_s=blocking, background_s=time.monotonic() - started)
                # After the report (queued by the local agent at once): the commit does not wait for it.
                held = False
                self._release(step, grant, ok=True, size=size, upload_s=put_s)
                record = SaveRecord(step=step, key=key, ok=True, size_bytes=size, sha256=digest,
                                    blocked_s=blocked_s, snapshot_s=snapshot_s, upload_s=upload_s, put_s=put_s,
                                    slot_wait_s=grant.wait_s, slot=grant.use, reported=reported)
                log.info("checkpoint shard of step %d saved: %s (%d bytes, paused %.3fs, slot %s after %.3fs, "
                         "upload %.3fs)", step, key, size, snapshot_s, grant.use, grant.wait_s, upload_s)
        finally:
            buffer.close()
            if held:  # a custom reporter raised: the slot goes back all the same
                self._release(step, grant, ok=False, size=0, upload_s=put_s)
        self.saves.append(record)
        return record

    def _put(self, step: int, key: str, buffer: io.BytesIO, size: int, grant: SlotGrant) -> ObjectInfo:
        """Upload within the slot: paced at its rate (lifted by a due save), renewed while it runs."""
        assert self.storage is not None
        pacer = Pacer(grant.rate_bytes_per_s, lifted=self._hurry)
        renewal = self.slots.keep(step, size, grant, pacer)
        try:
            if grant.rate_bytes_per_s is not None and isinstance(self.storage, PacedStorage):
                return self.storage.put_object_paced(key, buffer, length=size, pace=pacer)
            return self.storage.put_object(key, buffer, length=size)
        finally:
            renewal.stop()

    def _release(self, step: int, grant: SlotGrant, *, ok: bool, size: int, upload_s: float) -> None:
        """Give a granted slot back; in the background when the next save is due (the loop waits for
        this thread then, and must not wait for a round trip to the control plane)."""
        if grant.use != "granted":
            return
        if self._hurry.is_set() and not self._closing:
            threading.Thread(target=self.slots.release, args=(step,), daemon=True, name="trainyard-upload-slot-release",
                             kwargs={"ok": ok, "uploaded_bytes": size, "upload_s": upload_s}).start()
        else:
            self.slots.release(step, ok=ok, uploaded_bytes=size, upload_s=upload_s)

    # --- restoring ---

    def restore(self) -> int | None:
        """Restore the newest good candidate of ``ctx.restore_from``; its step, or None (fresh).

        Collective when distributed: call it on every rank, after init_distributed. Raises
        CheckpointUnavailableError when candidates exist but storage could not serve any of them,
        and CheckpointLoadError when a verified shard does not load (the state is then undefined).
        """
        candidates = candidates_of(self.ctx.restore_from)
        if not candidates:
            return None
        if self.storage is None:
            raise CheckpointUnavailableError(
                f"{len(candidates)} checkpoint(s) to restore but no checkpoint storage ({_STORAGE_VARS}) is set")
        main, rank, world = self.ctx.is_main, self.ctx.rank, self.ctx.world_size
        device = device_of(self.ctx)
        tried: list[Any] = []
        storage_trouble = False
        for candidate in candidates:
            step = candidate.get("step")
            tried.append(step)
            kept = None
            if self.memory is not None and isinstance(step, int):
                saver = candidate.get("attempt_number")
                kept = self.memory.get(step, attempt_number=saver, rank=rank, world_size=world)
            if kept is not None:
                # This rank's own copy of exactly that step; the others agree below as usual.
                manifest, fetched = None, Fetched(Problem.OK, state=kept, tier="process")
            else:
                manifest, fetched = resolve(self.storage, candidate)  # a reference: read the manifest
            if manifest is not None:
                fetched = fetch_shard(self.storage, manifest, rank=rank, world_size=world, names=self.state.names(),
                                      device=device, per_rank=self.state.names(per_rank=True),
                                      memory=self.agent_memory)
            if fetched.problem:
                log.warning("rank %d cannot restore step %s: %s", rank, step, fetched.detail)
            codes = agree(fetched.problem, rank=rank, world_size=world)
            if not any(codes):
                assert fetched.state is not None and isinstance(step, int)
                self._load(fetched.state, step)
                self.restored_from = "memory" if kept is not None else "storage"
                if self.auto:
                    self.next_save = step + (self.interval_steps or 1)
                self.restored_tiers = _tiers(agree(TIER_CODES[fetched.tier], rank=rank, world_size=world))
                if main:
                    tiers = ", ".join(f"{t}: {len(r)}" for t, r in self.restored_tiers.items())
                    log.info("restored checkpoint of step %d (%d candidate(s) tried; ranks served by %s)",
                             step, len(tried), tiers)
                    self.reporter.event(RESTORED, f"restored the checkpoint of step {step} (ranks served by {tiers})",
                                        {"step": step, "tiers": self.restored_tiers, **_named(candidate)})
                return step
            fetched.state = None
            reason = describe(codes)
            storage_trouble |= Problem.STORAGE in codes
            if main:
                log.warning("checkpoint of step %s unusable (%s); trying the next candidate", step, reason)
                self.reporter.event(FALLBACK, f"checkpoint of step {step} not restored: {reason}",
                                    {"step": step, "reason": reason, "unusable": is_bad(codes), **_named(candidate)})
        message = f"none of {len(tried)} checkpoint(s) (steps {tried}) could be restored"
        if storage_trouble:
            if main:
                self.reporter.event(RESTORE_FAILED, message + "; storage unreachable", {"steps": tried})
            raise CheckpointUnavailableError(message + ": storage errors (see the warnings above)")
        log.error("%s; STARTING FROM SCRATCH", message)
        if main:
            self.reporter.event(RESTORE_FAILED, message + "; starting from scratch", {"steps": tried})
        return None

    def _load(self, state: dict[str, Any], step: int) -> None:
        error: Exception | None = None
        try:
            self.state.load_state_dict(state, strict=True)
        except Exception as exc:
            error = exc
            log.error("rank %d could not load the checkpoint of step %d: %r", self.ctx.rank, step, exc)
        # Every rank learns whether all loaded, so none trains on while another raises.
        codes = agree(int(error is not None), rank=self.ctx.rank, world_size=self.ctx.world_size)
        if any(codes):
            failed = [r for r, c in enumerate(codes) if c]
            raise CheckpointLoadError(f"the checkpoint of step {step} did not load on ranks {failed}") from error


AUTO = "auto"


def _agree_max(values: list[int], *, world_size: int) -> list[int]:
    """Each value's maximum over the ranks (one all_reduce when distributed)."""
    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    packed = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX)
    return [int(v) for v in packed.tolist()]


def _tiers(codes: list[int]) -> dict[str, list[int]]:
    """Every rank's tier code (TIER_CODES) as the ranks each tier served, e.g. {"local": [0, 1]}."""
    names = {code: name for name, code in TIER_CODES.items()}
    out: dict[str, list[int]] = {}
    for rank, code in enumerate(codes):
        out.setdefault(names.get(code, "s3"), []).append(rank)
    return out


def _named(candidate: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint id a plan's reference gives (the control plane demotes it by id), if any."""
    cid = candidate.get("checkpoint_id")
    return {"checkpoint_id": cid} if isinstance(cid, str) and "shards" not in candidate else {}
