"""The worker's side of two-phase checkpoints: save this rank's shard, restore from a plan.

Saving (phase 1 of docs/architecture.md, "Two-phase checkpoints"): every rank serialises its whole
:class:`TrainState` with ``torch.save`` into memory (the consistency point: the loop is paused for
exactly that long), then a single background thread hashes it, uploads it to

    <prefix>/step-<step:09d>/attempt-<attempt:04d>/rank-<rank:05d>.pt   (trainyard.protocol.keys)

and reports it to the agent (LocalShard). The control plane commits the checkpoint once every rank
has reported (phase 2); no collective is needed here. At most one save is in flight: a save that
finds the previous upload still running waits for it. A failed upload never stops training: it
is logged and reported as ``checkpoint.save_failed``, and the control plane aborts that step.

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

from trainyard.protocol.keys import job_checkpoint_prefix, shard_key
from trainyard.protocol.storage import CheckpointStorage, ObjectInfo, PacedStorage
from worker_runtime.checkpoint.notify import (
    FALLBACK,
    RESTORE_FAILED,
    RESTORED,
    SAVE_FAILED,
    UPLOAD_UNSLOTTED,
    CheckpointReporter,
    ShardSink,
)
from worker_runtime.checkpoint.pacing import Pacer
from worker_runtime.checkpoint.restore import (
    Problem,
    agree,
    candidates_of,
    describe,
    fetch_shard,
    is_bad,
    resolve,
)
from worker_runtime.checkpoint.slots import SlotGrant, UploadSlots
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import device_of
from worker_runtime.state import TrainState

log = logging.getLogger(__name__)
_STORAGE_VARS = "TRAINYARD_STORAGE_ACCESS or TRAINYARD_S3_*"


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
    """Hashing and uploading, in the background (the slot wait not included)."""
    slot_wait_s: float = 0.0
    """Time the background thread waited for an upload slot."""
    slot: str = "none"
    """How the shard was uploaded: granted (within a slot), bypassed (without one), none (no slot service)."""
    reported: bool = False
    error: str | None = None


def storage_from_context(ctx: WorkerContext, *, timeout_s: float = 10.0, retries: int = 1) -> CheckpointStorage | None:
    """The worker's checkpoint storage, or None when it has none.

    Under an agent (TRAINYARD_STORAGE_ACCESS=presigned): presigned URLs per object, obtained through
    the agent; the worker holds no credential. Outside Trainyard: S3 from the script's own
    TRAINYARD_S3_* variables. Short timeouts and one retry: a dead S3 must cost a save seconds, not
    minutes.
    """
    if ctx.storage.get("access") == "presigned" and ctx.agent_url:
        from worker_runtime.checkpoint.presigned import AgentGrants, PresignedStorage

        source = AgentGrants(agent_url=ctx.agent_url, attempt_id=ctx.attempt_id, fencing_token=ctx.fencing_token,
                             rank=ctx.rank, agent_socket=ctx.agent_socket)
        return PresignedStorage(source, timeout_s=timeout_s, retries=retries)
    if not (ctx.storage.get("endpoint") and ctx.storage.get("bucket")):
        return None
    from worker_runtime.checkpoint.s3 import S3Config, S3Storage

    return S3Storage(S3Config.from_mapping(dict(ctx.storage)), timeout_s=timeout_s, retries=retries)


class CheckpointManager:
    """Saves and restores one rank's :class:`TrainState`; a no-op without interval or storage.

    ``interval_steps`` and ``storage`` default to the job's settings (``ctx.checkpoint``) and the
    worker's storage (storage_from_context); ``reporter`` to the agent of ``ctx``. ``async_upload=False`` makes
    ``save`` return only after the upload and report. ``upload_delay_s`` sleeps between upload and
    report (tests use it to kill a worker mid-checkpoint). ``slots`` defaults to the agent of
    ``ctx`` (slots.py).
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
    ) -> None:
        interval = interval_steps if interval_steps is not None else ctx.checkpoint.get("interval_steps")
        if interval is not None and (not isinstance(interval, int) or isinstance(interval, bool) or interval < 1):
            raise ValueError(f"interval_steps must be a positive integer or None, got {interval!r}")
        self.ctx = ctx
        self.state = state
        self.interval_steps: int | None = interval
        self.storage = storage if storage is not None else storage_from_context(ctx)
        self.reporter: ShardSink = reporter if reporter is not None else CheckpointReporter(ctx)
        self.prefix = (ctx.checkpoint_prefix or job_checkpoint_prefix(ctx.job_id)).strip("/")
        self._async = async_upload
        self._upload_delay_s = upload_delay_s
        self.slots = slots if slots is not None else UploadSlots(ctx)
        self._hurry = threading.Event()  # set by a save that finds the previous upload still waiting
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[SaveRecord] | None = None
        self._closed = False
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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def should_save(self, step: int) -> bool:
        return self.enabled and step > 0 and step % (self.interval_steps or 1) == 0

    def shard_key(self, step: int) -> str:
        return shard_key(self.prefix, step, self.ctx.attempt_number, self.ctx.rank)

    # --- saving ---

    def save(self, step: int) -> bool:
        """Snapshot the state now and upload it in the background; False if disabled or stale.

        Call it on every rank after the optimizer step of ``step``. It raises only when the state
        cannot be serialised (a bug); storage and agent failures are reported, never raised.
        """
        if not self.enabled or self._closed or getattr(self.reporter, "stale", False):
            return False
        t0 = time.monotonic()
        pending = self._pending
        if pending is not None and not pending.done():
            self._hurry.set()  # the loop never waits for a slot or a pace: the upload in flight goes now
        self.wait()
        self._hurry.clear()
        t1 = time.monotonic()
        buffer = io.BytesIO()
        torch.save(self.state.shard_state_dict(self.ctx.rank), buffer)
        timing = (t1 - t0, time.monotonic() - t1)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainyard-checkpoint")
        self._pending = self._executor.submit(self._upload, step, buffer, timing)
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
        if self._executor is not None:
            self._executor.shutdown(wait=drained)
        self._closed = True
        return drained

    def _upload(self, step: int, buffer: io.BytesIO, timing: tuple[float, float]) -> SaveRecord:
        key = self.shard_key(step)
        blocked_s, snapshot_s = timing
        size, digest = 0, ""
        grant = SlotGrant(use="none", wait_s=0.0)
        started = time.monotonic()
        try:
            with buffer.getbuffer() as view:
                size, digest = view.nbytes, hashlib.sha256(view).hexdigest()
            buffer.seek(0)
            grant = self.slots.acquire(step, size, hurry=self._hurry)
            if grant.stale:
                if hasattr(self.reporter, "stale"):
                    self.reporter.stale = True  # later saves are skipped, as after a refused report
                raise StaleSlotError("the attempt is stale: no upload slot, nothing uploaded")
            if grant.use == "bypassed":
                self.reporter.event(UPLOAD_UNSLOTTED, f"step {step} uploaded without a slot: {grant.reason}"[:4096],
                                    {"step": step, "waited_s": round(grant.wait_s, 3)})
            started = time.monotonic()
            info = self._put(step, key, buffer, size, grant)
            upload_s = time.monotonic() - started
            if info.size != size:
                raise OSError(f"storage holds {info.size} bytes under {key}, {size} were sent")
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            upload_s = time.monotonic() - started
            self._release(step, grant, ok=False, size=0, upload_s=upload_s)
            if not grant.stale:
                log.error("checkpoint of step %d not saved (upload of %s failed: %s); training continues",
                          step, key, error)
                self.reporter.event(SAVE_FAILED, f"upload of {key} failed: {error}"[:4096], {"step": step})
            record = SaveRecord(step=step, key=key, ok=False, size_bytes=size, sha256=digest,
                                blocked_s=blocked_s, snapshot_s=snapshot_s, upload_s=upload_s,
                                slot_wait_s=grant.wait_s, slot=grant.use, error=error)
        else:
            if self._upload_delay_s > 0:
                time.sleep(self._upload_delay_s)
            stats = {"wait_s": round(grant.wait_s, 6), "upload_s": round(upload_s, 6), "slot": grant.use}
            reported = self.reporter.shard(step=step, key=key, size_bytes=size, sha256=digest, upload=stats)
            # After the report (queued by the local agent at once): the commit does not wait for it.
            self._release(step, grant, ok=True, size=size, upload_s=upload_s)
            record = SaveRecord(step=step, key=key, ok=True, size_bytes=size, sha256=digest,
                                blocked_s=blocked_s, snapshot_s=snapshot_s, upload_s=upload_s,
                                slot_wait_s=grant.wait_s, slot=grant.use, reported=reported)
            log.info("checkpoint shard of step %d saved: %s (%d bytes, paused %.3fs, slot %s after %.3fs, "
                     "upload %.3fs)", step, key, size, snapshot_s, grant.use, grant.wait_s, upload_s)
        finally:
            buffer.close()
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
        if self._hurry.is_set():
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
            manifest, fetched = resolve(self.storage, candidate)  # a reference: read the manifest
            if manifest is not None:
                fetched = fetch_shard(self.storage, manifest, rank=rank, world_size=world, names=self.state.names(),
                                      device=device, per_rank=self.state.names(per_rank=True))
            if fetched.problem:
                log.warning("rank %d cannot restore step %s: %s", rank, step, fetched.detail)
            codes = agree(fetched.problem, rank=rank, world_size=world)
            if not any(codes):
                assert fetched.state is not None and isinstance(step, int)
                self._load(fetched.state, step)
                if main:
                    log.info("restored checkpoint of step %d (%d candidate(s) tried)", step, len(tried))
                    self.reporter.event(RESTORED, f"restored the checkpoint of step {step}",
                                        {"step": step, **_named(candidate)})
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


def _named(candidate: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint id a plan's reference gives (the control plane demotes it by id), if any."""
    cid = candidate.get("checkpoint_id")
    return {"checkpoint_id": cid} if isinstance(cid, str) and "shards" not in candidate else {}
