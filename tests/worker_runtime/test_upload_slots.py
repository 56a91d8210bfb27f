"""The worker's side of checkpoint upload slots (worker_runtime/checkpoint/slots.py, pacing.py) against
a real S3 server and a fake agent on a real socket: the wait happens in the upload thread and a due
save ends it (the loop never waits for a slot), an unreachable slot service is waited out for a
bounded time and then bypassed with an event, a stale attempt uploads nothing, and a granted rate
paces the upload while renewals keep the lease."""

from __future__ import annotations

import io
import threading
from typing import Any

import torch

from tests.conftest import S3Bucket
from tests.helpers import free_port
from tests.worker_runtime.fake_agent import GRANTED, FakeAgent
from tests.worker_runtime.test_checkpoint_manager import SMALL, _ctx, _raw, _storage_env
from trainyard.storage.pacing import Pacer, paced_chunks
from worker_runtime import CheckpointManager, WorkerContext
from worker_runtime.checkpoint.slots import UploadSlots
from worker_runtime.examples.tiny_gpt import Trainer
from worker_runtime.state import TrainState

WAITING: dict[str, Any] = {"slot_id": "slot-1", "state": "waiting", "position": 3, "retry_after_s": 0.1,
                           "rate_bytes_per_s": None, "ttl_s": 30.0, "max_wait_s": None}


def _asks(agent: FakeAgent, step: int) -> list[dict[str, Any]]:
    return [r.body for r in agent.of("upload-slot") if r.body["step"] == step]


def _releases(agent: FakeAgent, step: int) -> list[dict[str, Any]]:
    return [r.body for r in agent.of("release") if r.body["step"] == step]


def test_a_due_save_ends_the_slot_wait_and_the_upload_goes_without_one(s3_bucket: S3Bucket,
                                                                        fake_agent: FakeAgent) -> None:
    ctx = _ctx(_storage_env(s3_bucket), fake_agent)
    fake_agent.slot_answer = dict(WAITING)  # the queue never moves
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state) as manager:
        assert manager.save(4)
        fake_agent.wait_for("upload-slot", 2)  # step 4 is waiting for its slot, in the background
        loop = threading.Thread(target=manager.save, args=(8,), daemon=True)
        loop.start()
        loop.join(30)
        waited_for_a_slot = loop.is_alive()
        fake_agent.slot_answer = dict(GRANTED)  # step 8's slot comes
        assert not waited_for_a_slot, "the training loop waited for an upload slot"
        assert [(s.step, s.ok, s.slot) for s in manager.saves][:1] == [(4, True, "bypassed")]
    records = list(manager.saves)
    assert [(s.step, s.ok, s.slot) for s in records] == [(4, True, "bypassed"), (8, True, "granted")]
    [unslotted] = fake_agent.events("checkpoint.upload_unslotted")
    assert unslotted["data"]["step"] == 4 and "next save due" in unslotted["message"]
    assert "queue position 3" in unslotted["message"]
    shards = {s["step"]: s for s in fake_agent.shards()}
    assert shards[4]["upload"]["slot"] == "bypassed" and shards[4]["upload"]["wait_s"] > 0
    assert shards[8]["upload"]["slot"] == "granted"
    fake_agent.wait_for("release", 2)
    assert [r["ok"] for r in _releases(fake_agent, 4)] == [False]  # the queue place is given back
    assert [(r["ok"], r["uploaded_bytes"]) for r in _releases(fake_agent, 8)] == [(True, records[1].size_bytes)]
    assert all(_raw(s3_bucket).stat(s.key) is not None for s in records)


def test_an_unreachable_slot_service_is_waited_out_then_bypassed(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    ctx = _ctx(_storage_env(s3_bucket), fake_agent)
    fake_agent.always["upload-slot"] = 503
    slots = UploadSlots(ctx, unreachable_s=0.3)
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state, slots=slots, async_upload=False) as manager:
        assert manager.save(4)
    [record] = manager.saves
    assert record.ok and record.slot == "bypassed" and record.slot_wait_s >= 0.3
    [unslotted] = fake_agent.events("checkpoint.upload_unslotted")
    assert "unreachable" in unslotted["message"]
    assert fake_agent.shards()[0]["upload"]["slot"] == "bypassed"


def test_a_stale_attempt_gets_no_slot_and_uploads_nothing(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    ctx = _ctx(_storage_env(s3_bucket), fake_agent)
    fake_agent.always["upload-slot"] = 409
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state, async_upload=False) as manager:
        assert manager.save(4)
        assert manager.save(8) is False  # stale: later saves are skipped
    [record] = manager.saves
    assert not record.ok and "stale" in (record.error or "")
    assert _raw(s3_bucket).stat(record.key) is None
    assert fake_agent.shards() == [] and fake_agent.events() == []


def test_no_slot_service_means_the_upload_goes_ahead(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    ctx = _ctx(_storage_env(s3_bucket), fake_agent)
    fake_agent.always["upload-slot"] = 404  # an agent that predates slots
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state, async_upload=False) as manager:
        assert manager.save(4)
    assert [(s.ok, s.slot) for s in manager.saves] == [(True, "none")]
    assert fake_agent.events() == []


def _big_state(size: int) -> TrainState:
    state = TrainState()
    state.register("blob", torch.nn.Embedding(size // 4000, 1000))  # float32: about ``size`` bytes
    return state


def test_a_granted_rate_paces_the_upload_and_renewals_keep_the_lease(s3_bucket: S3Bucket,
                                                                      fake_agent: FakeAgent) -> None:
    ctx: WorkerContext = _ctx(_storage_env(s3_bucket), fake_agent)
    rate = 1_000_000
    fake_agent.slot_answer = {**GRANTED, "rate_bytes_per_s": rate, "ttl_s": 1.5}
    with CheckpointManager(ctx, _big_state(1_500_000), async_upload=False) as manager:
        assert manager.save(4)
    [record] = manager.saves
    assert record.ok and record.slot == "granted"
    burst = 4 * 64 * 1024
    assert record.upload_s >= (record.size_bytes - burst) / rate  # no faster than the slot's rate
    assert len(_asks(fake_agent, 4)) >= 2 and all(a["wait_s"] == 0 for a in _asks(fake_agent, 4)[1:])  # renewals
    [release] = _releases(fake_agent, 4)
    assert release["ok"] and release["uploaded_bytes"] == record.size_bytes and release["upload_s"] > 0
    stored = _raw(s3_bucket).get_bytes(record.key)
    assert len(stored) == record.size_bytes


def test_a_granted_slot_is_released_when_the_upload_fails_and_when_the_worker_leaves(
        s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    # A failed upload gives its slot back at once, marked failed.
    dead = _storage_env(s3_bucket, endpoint=f"127.0.0.1:{free_port()}")  # nothing listens there
    ctx = _ctx(dead, fake_agent)
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state, async_upload=False) as manager:
        assert manager.save(4)
    [failed] = manager.saves
    assert not failed.ok and failed.slot == "granted"
    assert [(r["ok"], r["uploaded_bytes"]) for r in _releases(fake_agent, 4)] == [(False, 0)]

    # A worker that leaves (close with a timeout: an exception or SIGTERM unwinding the loop) while its
    # upload crawls at its slot's pace: the pace is lifted, the upload ends and the slot is released
    # on the upload thread, which the interpreter joins at exit (a daemon release could be cut off).
    ctx = _ctx(_storage_env(s3_bucket), fake_agent)
    fake_agent.slot_answer = {**GRANTED, "rate_bytes_per_s": 50_000}  # about 30 s for this state
    manager = CheckpointManager(ctx, _big_state(1_500_000))
    assert manager.save(8)
    fake_agent.wait_for("upload-slot", 1)
    assert manager.close(timeout=0.5) is False  # still uploading
    assert manager.wait(30)
    [release] = _releases(fake_agent, 8)
    [record] = [s for s in manager.saves if s.step == 8]
    assert record.ok and release["ok"] and release["uploaded_bytes"] == record.size_bytes
    assert record.put_s < 10  # unpaced once the worker left

    # Leaving while still queued: the wait ends and the queue place is given back.
    fake_agent.slot_answer = dict(WAITING)
    manager = CheckpointManager(ctx, Trainer(SMALL, ctx).state)
    assert manager.save(12)
    fake_agent.wait_for("upload-slot", 3)
    manager.close(timeout=0.2)
    fake_agent.wait_for("release", 3)
    assert [r["ok"] for r in _releases(fake_agent, 12)] == [False]


def test_a_lifted_pacer_sends_at_once_and_a_short_body_fails() -> None:
    pacer = Pacer(1)  # one byte a second: only lifting lets 64 KiB through in this test's life
    chunks = paced_chunks(io.BytesIO(b"x" * 300_000), 300_000, pacer)
    first = next(chunks)
    pacer.lift()
    assert len(first) + sum(len(c) for c in chunks) == 300_000
    try:
        list(paced_chunks(io.BytesIO(b"short"), 10, Pacer(None)))
    except EOFError as exc:
        assert "5 bytes before" in str(exc)
    else:
        raise AssertionError("a body shorter than its length must fail the upload")
