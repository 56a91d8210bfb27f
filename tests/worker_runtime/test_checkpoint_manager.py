"""CheckpointManager against a real S3 server and a fake agent on a real socket."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from tests.conftest import S3Bucket
from tests.helpers import ProcessReaper, free_port
from tests.worker_runtime.fake_agent import FakeAgent, manifest_from_shards
from tests.worker_runtime.torchrun import run_torchrun
from trainyard.protocol.keys import MANIFEST_FORMAT, shard_key
from trainyard.storage.s3 import S3Config, S3Storage
from worker_runtime import CheckpointManager, Reporter, WorkerContext
from worker_runtime.checkpoint.manager import CheckpointUnavailableError
from worker_runtime.checkpoint.notify import CheckpointReporter
from worker_runtime.checkpoint.restore import Problem, agree, describe, fetch_shard
from worker_runtime.examples.tiny_gpt import Config, Trainer
from worker_runtime.state import DataPosition, StepCounter, TrainState

SMALL = Config(steps=12, batch_size=4, seq_len=16, d_model=32, layers=1, heads=2, log_every=4)
JOB = "job-ckpt"
PREFIX = f"jobs/{JOB}/checkpoints"


@pytest.fixture(scope="module")
def reference() -> str:
    """weights_sha256 of the uninterrupted run, without any checkpointing."""
    ctx = WorkerContext(device="cpu")
    with Reporter(ctx, echo=False) as reporter:
        result = Trainer(SMALL, ctx).fit(reporter)
    assert result is not None
    return str(result["weights_sha256"])


def _storage_env(bucket: S3Bucket, endpoint: str | None = None) -> dict[str, str]:
    return {"endpoint": endpoint or bucket.endpoint, "access_key": bucket.access_key,
            "secret_key": bucket.secret_key, "bucket": bucket.bucket, "secure": "0"}


def _ctx(storage: dict[str, str], agent: FakeAgent, *, attempt: int = 0, restore_from: Any = None,
         interval: int | None = 4) -> WorkerContext:
    return WorkerContext(
        job_id=JOB, attempt_id=f"att-{attempt}", attempt_number=attempt, fencing_token=f"tok-{attempt}",
        agent_url=agent.url, device="cpu", checkpoint={"interval_steps": interval} if interval else {},
        restore_from=restore_from, storage=storage, checkpoint_prefix=PREFIX,
    )


def _run(ctx: WorkerContext, until: int | None = None, **manager: Any) -> tuple[dict[str, Any], int | None]:
    torch.manual_seed(4321)  # a resumed process starts with other RNG state
    trainer = Trainer(SMALL, ctx)
    with Reporter(ctx, echo=False) as reporter, CheckpointManager(ctx, trainer.state, **manager) as ckpt:
        restored = ckpt.restore()
        result = trainer.fit(reporter, until=until, checkpoints=ckpt)
    assert result is not None
    return result, restored


def _raw(bucket: S3Bucket) -> S3Storage:
    return S3Storage(S3Config(endpoint=bucket.endpoint, bucket=bucket.bucket, access_key=bucket.access_key,
                              secret_key=bucket.secret_key))


def _first_attempt(bucket: S3Bucket, agent: FakeAgent) -> dict[int, dict[str, Any]]:
    """Attempt 0 runs to step 8 (checkpoints at 4 and 8); the manifests the control plane commits."""
    _run(_ctx(_storage_env(bucket), agent), until=8)
    steps = sorted({s["step"] for s in agent.shards()})
    assert steps == [4, 8]
    return {step: manifest_from_shards(agent.shards(), job_id=JOB, attempt_id="att-0", attempt_number=0,
                                       step=step, world_size=1) for step in steps}


def test_save_then_restore_through_s3_is_bit_identical(s3_bucket: S3Bucket, fake_agent: FakeAgent,
                                                        reference: str) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    store = _raw(s3_bucket)
    for body in fake_agent.shards():
        assert body["key"] == shard_key(PREFIX, body["step"], 0, 0)
        assert body["key"] == f"{PREFIX}/step-{body['step']:09d}/attempt-0000/rank-00000.pt"
        assert (body["rank"], body["world_size"], body["fencing_token"]) == (0, 1, "tok-0")
        data = store.get_bytes(body["key"])
        assert (len(data), hashlib.sha256(data).hexdigest()) == (body["size_bytes"], body["sha256"])

    plan = {"candidates": [manifests[8], manifests[4]]}
    result, restored = _run(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1, restore_from=plan))
    assert restored == 8
    assert result["weights_sha256"] == reference and result["steps"] == SMALL.steps
    [event] = fake_agent.events("checkpoint.restored")
    assert (event["data"], event["rank"], event["fencing_token"]) == ({"step": 8, "tiers": {"s3": [0]}}, 0, "tok-1")
    assert fake_agent.events("checkpoint.fallback") == []
    # The resumed attempt checkpoints under its own attempt number.
    assert [s["key"] for s in fake_agent.shards(12)] == [f"{PREFIX}/step-000000012/attempt-0001/rank-00000.pt"]


def _flip_a_byte(store: S3Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    key = manifest["shards"][0]["key"]
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    return manifest


def _truncate(store: S3Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    key = manifest["shards"][0]["key"]
    store.put_bytes(key, store.get_bytes(key)[:-10])
    return manifest


def _delete(store: S3Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    store.delete(manifest["shards"][0]["key"])
    return manifest


def _other_world_size(store: S3Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    shard = dict(manifest["shards"][0], rank=1, key=manifest["shards"][0]["key"].replace("rank-00000", "rank-00001"))
    return {**manifest, "world_size": 2, "shards": [manifest["shards"][0], shard]}


def _garbage_with_matching_sha(store: S3Storage, manifest: dict[str, Any]) -> dict[str, Any]:
    key, junk = manifest["shards"][0]["key"], b"not a torch file" * 100
    store.put_bytes(key, junk)
    shard = dict(manifest["shards"][0], size_bytes=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    return {**manifest, "shards": [shard]}


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_flip_a_byte, "sha256 differs"),
        (_truncate, "size differs"),
        (_delete, "missing"),
        (_other_world_size, "world size"),
        (_garbage_with_matching_sha, "does not deserialise"),
    ],
)
def test_a_bad_checkpoint_falls_back_to_the_previous_one(
    s3_bucket: S3Bucket, fake_agent: FakeAgent, reference: str, damage: Any, reason: str
) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    bad = damage(_raw(s3_bucket), manifests[8])
    plan = {"candidates": [bad, manifests[4]]}
    result, restored = _run(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1, restore_from=plan))
    assert restored == 4
    assert result["weights_sha256"] == reference
    [fallback] = fake_agent.events("checkpoint.fallback")
    assert fallback["data"]["step"] == 8 and reason in fallback["data"]["reason"], fallback
    assert [e["data"] for e in fake_agent.events("checkpoint.restored")] == [{"step": 4, "tiers": {"s3": [0]}}]


def test_when_every_candidate_is_bad_it_starts_fresh(s3_bucket: S3Bucket, fake_agent: FakeAgent,
                                                      reference: str) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    store = _raw(s3_bucket)
    plan = {"candidates": [_delete(store, manifests[8]), _flip_a_byte(store, manifests[4])]}
    result, restored = _run(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1, restore_from=plan))
    assert restored is None
    assert result["weights_sha256"] == reference and result["initial_loss"] is not None
    assert [e["data"]["step"] for e in fake_agent.events("checkpoint.fallback")] == [8, 4]
    [failed] = fake_agent.events("checkpoint.restore_failed")
    assert failed["data"] == {"steps": [8, 4]}
    assert fake_agent.events("checkpoint.restored") == []


def test_unreachable_s3_fails_saves_but_not_training(s3_bucket: S3Bucket, fake_agent: FakeAgent,
                                                      reference: str) -> None:
    dead = _storage_env(s3_bucket, endpoint=f"127.0.0.1:{free_port()}")  # nothing listens there
    started = time.monotonic()
    result, restored = _run(_ctx(dead, fake_agent))
    assert time.monotonic() - started < 20
    assert restored is None and result["weights_sha256"] == reference
    failed = fake_agent.events("checkpoint.save_failed")
    assert [e["data"] for e in failed] == [{"step": 4}, {"step": 8}, {"step": 12}]
    assert "rank-00000.pt" in failed[0]["message"]
    assert fake_agent.shards() == []


def test_restoring_from_unreachable_s3_fails_the_attempt(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    dead = _storage_env(s3_bucket, endpoint=f"127.0.0.1:{free_port()}")
    ctx = _ctx(dead, fake_agent, attempt=1, restore_from={"candidates": [manifests[8]]})
    manager = CheckpointManager(ctx, Trainer(SMALL, ctx).state)
    with pytest.raises(CheckpointUnavailableError, match="storage"):
        manager.restore()
    [fallback] = fake_agent.events("checkpoint.fallback")
    assert "storage error" in fallback["data"]["reason"]


def test_disabled_without_interval_or_storage(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    no_interval = _ctx(_storage_env(s3_bucket), fake_agent, interval=None)
    no_storage = _ctx({}, fake_agent)
    for ctx in (no_interval, no_storage):
        manager = CheckpointManager(ctx, Trainer(SMALL, ctx).state)
        assert not manager.enabled and not manager.should_save(4)
        assert manager.save(4) is False and manager.restore() is None
        manager.close()
    assert fake_agent.requests == []
    planned = _ctx({}, fake_agent, restore_from={"candidates": [{"step": 4, "shards": []}]})
    with pytest.raises(CheckpointUnavailableError, match="no checkpoint storage"):
        CheckpointManager(planned, Trainer(SMALL, planned).state).restore()


@pytest.fixture
def trainer_ctx(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> Iterator[WorkerContext]:
    yield _ctx(_storage_env(s3_bucket), fake_agent)


def test_uploads_in_the_background_one_at_a_time(trainer_ctx: WorkerContext, fake_agent: FakeAgent) -> None:
    trainer = Trainer(SMALL, trainer_ctx)
    with CheckpointManager(trainer_ctx, trainer.state, upload_delay_s=0.5) as manager:
        started = time.monotonic()
        assert manager.save(4)
        assert time.monotonic() - started < 0.4  # the loop goes on while the upload runs
        assert fake_agent.shards() == []
        assert manager.save(8)  # waits for the save of step 4 first
        assert [s.step for s in manager.saves] == [4]
    records = list(manager.saves)
    assert [s.step for s in records] == [4, 8] and all(s.ok and s.reported for s in records)
    assert records[1].blocked_s > 0.2 and records[0].snapshot_s < 1.0
    assert [s["step"] for s in fake_agent.shards()] == [4, 8]  # close() drained the last one


def test_an_async_save_holds_its_steps_state_while_training_changes_it(
        trainer_ctx: WorkerContext, fake_agent: FakeAgent, s3_bucket: S3Bucket) -> None:
    # The background part (serialise, hash, upload) starts only once the loop has changed the live
    # weights: what is stored must still be the state at the save, the host copy taken while blocked.
    trainer = Trainer(SMALL, trainer_ctx)
    at_save = {name: t.clone() for name, t in trainer.model.state_dict().items()}
    gate = threading.Event()
    with CheckpointManager(trainer_ctx, trainer.state) as manager:
        manager._executor = ThreadPoolExecutor(max_workers=1)
        manager._executor.submit(gate.wait, 10)
        assert manager.save(4)
        with torch.no_grad():
            for param in trainer.model.parameters():
                param.add_(1.0)
        gate.set()
    [shard] = fake_agent.shards()
    saved = torch.load(io.BytesIO(_raw(s3_bucket).get_bytes(shard["key"])), weights_only=False)
    assert saved["model"].keys() == at_save.keys()
    assert all(torch.equal(saved["model"][name], t) for name, t in at_save.items())
    live = trainer.model.state_dict()
    assert any(not torch.equal(live[name], t) for name, t in at_save.items())  # the loop did move on
    assert shard["blocking_s"] > 0 and shard["background_s"] > 0


def test_a_save_while_the_previous_uploads_is_skipped_when_asked(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    ctx = dataclasses.replace(_ctx(_storage_env(s3_bucket), fake_agent),
                              checkpoint={"interval_steps": 4, "when_busy": "skip"})
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state, upload_delay_s=1.0) as manager:
        assert manager.save(4)
        assert manager.save(8) is False  # step 4's upload is still running: skipped, not waited for
        assert manager.saves[-1].error == "skipped"
    [skipped] = fake_agent.events("checkpoint.skipped")
    assert skipped["data"] == {"step": 8} and "still uploading" in skipped["message"]
    assert [s["step"] for s in fake_agent.shards()] == [4]
    with pytest.raises(ValueError, match="when_busy"):
        bad = dataclasses.replace(ctx, checkpoint={"interval_steps": 4, "when_busy": "later"})
        CheckpointManager(bad, Trainer(SMALL, bad).state)


def test_shard_report_can_wait_for_the_control_plane(trainer_ctx: WorkerContext, fake_agent: FakeAgent) -> None:
    fake_agent.committed_steps = [4]
    reporter = CheckpointReporter(trainer_ctx, wait_ack=True)
    with CheckpointManager(trainer_ctx, Trainer(SMALL, trainer_ctx).state, reporter=reporter,
                           async_upload=False) as manager:
        assert manager.save(4)
    [request] = fake_agent.of("shards")
    assert request.query == "wait=1" and reporter.committed_steps == {4}


def test_a_stale_attempt_stops_saving(trainer_ctx: WorkerContext, fake_agent: FakeAgent) -> None:
    fake_agent.always["shards"] = 409
    with CheckpointManager(trainer_ctx, Trainer(SMALL, trainer_ctx).state, async_upload=False) as manager:
        assert manager.save(4)
        assert manager.saves[-1].ok and not manager.saves[-1].reported
        assert manager.save(8) is False  # the agent said the attempt is superseded
    assert len(fake_agent.shards()) == 1


def test_sharded_fsdp2_state_saves_local_shards_and_restores(process_reaper: ProcessReaper,
                                                             s3_bucket: S3Bucket) -> None:
    env = {f"TRAINYARD_S3_{k.upper()}": v for k, v in _storage_env(s3_bucket).items()}
    ranks, stdout = run_torchrun(process_reaper, ["tests.worker_runtime.fsdp_checkpoint_worker"],
                                 {**env, "TRAINYARD_DEVICE": "cpu"})
    assert [r["restored"] for r in ranks] == [2, 2] and all(r["same"] for r in ranks), stdout
    # Each rank's shard holds its half of the parameters (and of the optimizer moments), not all.
    assert [r["local_numel"] * 2 for r in ranks] == [r["global_numel"] for r in ranks]
    full_fp32 = 3 * 4 * ranks[0]["global_numel"]  # parameters + two AdamW moments
    assert all(r["size_bytes"] < full_fp32 for r in ranks), ranks


def test_a_rank_restores_replicated_state_from_rank_zeros_verified_shard(s3_bucket: S3Bucket) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    states = []
    for rank in (0, 1):
        state = TrainState()
        state.register("model", model)
        state.register("step", StepCounter(6))
        state.register("data", DataPosition(world_size=2, offset=6 + rank), per_rank=True)  # differs by rank
        states.append(state.shard_state_dict(rank))
    store = _raw(s3_bucket)
    shards = []
    for rank, saved in enumerate(states):
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        key = f"restore-test/step-6/rank-{rank}.pt"
        store.put_bytes(key, buffer.getvalue())
        shards.append({"rank": rank, "key": key, "size_bytes": len(buffer.getvalue()),
                       "sha256": hashlib.sha256(buffer.getvalue()).hexdigest()})
    assert shards[1]["size_bytes"] < shards[0]["size_bytes"] / 2  # rank 1 wrote no weights
    manifest = {"format": MANIFEST_FORMAT, "step": 6, "world_size": 2, "shards": shards}
    names, per_rank = ["model", "step", "data"], ["data"]

    def fetch(rank: int) -> Any:
        return fetch_shard(store, manifest, rank=rank, world_size=2, names=names, per_rank=per_rank,
                           device=torch.device("cpu"))

    got = fetch(1)
    assert got.problem == Problem.OK and got.state is not None
    assert torch.equal(got.state["model"]["weight"], model.weight) and got.state["step"] == {"step": 6}
    assert got.state["data"]["offset"] == 7  # its own position, not rank 0's
    store.put_bytes(shards[0]["key"], store.get_bytes(shards[0]["key"])[::-1])  # rank 0's shard damaged
    damaged = fetch(1)
    assert damaged.problem == Problem.REPLICATED and "sha256" in damaged.detail
    assert describe([Problem.SHA256, Problem.REPLICATED]) == (
        "rank 0: shard sha256 differs from the manifest; "
        "rank 1: rank 0's shard, which holds the replicated state, is unusable")
    store.delete(shards[1]["key"])
    assert fetch(1).problem == Problem.MISSING  # rank 0's shard never stands in for its own


def test_ranks_never_decide_alone_without_a_process_group(s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    assert not torch.distributed.is_initialized()
    assert agree(3, rank=0, world_size=1) == [3]
    for problem in (0, 6):  # a good shard or a bad one: either way no rank may decide alone
        with pytest.raises(RuntimeError, match="without a process group"):
            agree(problem, rank=1, world_size=2)
    # Through the manager: a 2-rank context with a restore plan but no process group refuses to
    # restore rather than loading what only this rank has checked.
    manifests = _first_attempt(s3_bucket, fake_agent)
    ctx = dataclasses.replace(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1,
                                   restore_from={"candidates": [manifests[8]]}), world_size=2)
    with CheckpointManager(ctx, Trainer(SMALL, ctx).state) as ckpt, \
            pytest.raises(RuntimeError, match="without a process group"):
        ckpt.restore()


def _publish(store: S3Storage, manifest: dict[str, Any], checkpoint_id: str) -> dict[str, Any]:
    """What the control plane's commit does (manifest.json beside the shards) and the reference
    to it that its restore plan hands out instead of the manifest."""
    payload = json.dumps({**manifest, "checkpoint_id": checkpoint_id}, indent=1, sort_keys=True).encode()
    store.put_bytes(manifest["manifest_key"], payload)
    return {"checkpoint_id": checkpoint_id, "step": manifest["step"], "attempt_number": manifest["attempt_number"],
            "world_size": manifest["world_size"], "manifest_key": manifest["manifest_key"],
            "manifest_sha256": hashlib.sha256(payload).hexdigest(), "manifest_size_bytes": len(payload)}


def test_restores_from_a_reference_by_reading_the_manifest_from_s3(s3_bucket: S3Bucket, fake_agent: FakeAgent,
                                                                    reference: str) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    store = _raw(s3_bucket)
    refs = {step: _publish(store, m, f"id-{step}") for step, m in manifests.items()}
    plan = {"format": "trainyard.restore/2", "candidates": [refs[8], refs[4]]}
    result, restored = _run(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1, restore_from=plan))
    assert restored == 8 and result["weights_sha256"] == reference
    assert [e["data"] for e in fake_agent.events("checkpoint.restored")] == [
        {"step": 8, "tiers": {"s3": [0]}, "checkpoint_id": "id-8"}]
    assert fake_agent.events("checkpoint.fallback") == []


@pytest.mark.parametrize("damage", ["tampered", "missing", "other checkpoint", "bad shard"])
def test_a_bad_referenced_manifest_falls_back_and_names_the_checkpoint(
    s3_bucket: S3Bucket, fake_agent: FakeAgent, reference: str, damage: str
) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    store = _raw(s3_bucket)
    refs = {step: _publish(store, m, f"id-{step}") for step, m in manifests.items()}
    key = refs[8]["manifest_key"]
    if damage == "tampered":
        store.put_bytes(key, store.get_bytes(key).replace(b'"step": 8', b'"step": 9'))
    elif damage == "missing":
        store.delete(key)
    elif damage == "other checkpoint":
        refs[8] = {**_publish(store, manifests[8], "id-someone-else"), "checkpoint_id": "id-8"}
    else:
        _flip_a_byte(store, manifests[8])
    plan = {"candidates": [refs[8], refs[4]]}
    result, restored = _run(_ctx(_storage_env(s3_bucket), fake_agent, attempt=1, restore_from=plan))
    assert restored == 4 and result["weights_sha256"] == reference
    [fallback] = fake_agent.events("checkpoint.fallback")
    assert fallback["data"]["checkpoint_id"] == "id-8" and fallback["data"]["unusable"] is True, fallback
    expected = "sha256 differs" if damage == "bad shard" else "manifest"
    assert expected in fallback["data"]["reason"], fallback


def test_a_manifest_storage_cannot_serve_is_not_evidence_against_the_checkpoint(
        s3_bucket: S3Bucket, fake_agent: FakeAgent) -> None:
    manifests = _first_attempt(s3_bucket, fake_agent)
    ref = _publish(_raw(s3_bucket), manifests[8], "id-8")
    dead = _storage_env(s3_bucket, endpoint=f"127.0.0.1:{free_port()}")
    ctx = _ctx(dead, fake_agent, attempt=1, restore_from={"candidates": [ref]})
    with pytest.raises(CheckpointUnavailableError, match="storage"):
        CheckpointManager(ctx, Trainer(SMALL, ctx).state).restore()
    [fallback] = fake_agent.events("checkpoint.fallback")
    assert fallback["data"]["unusable"] is False and fallback["data"]["checkpoint_id"] == "id-8"


def test_a_manager_left_on_an_error_stops_waiting_for_its_upload(
        trainer_ctx: WorkerContext, monkeypatch: pytest.MonkeyPatch) -> None:
    """A script leaving its ``with CheckpointManager`` on an error (a peer failed) must not wait out
    the upload in flight: the process has to exit, or to ask its agent for the next attempt within
    the handover wait (tiny_gpt --restartable). A clean exit still drains it."""
    import worker_runtime.checkpoint.manager as manager_module

    monkeypatch.setattr(manager_module, "ERROR_DRAIN_S", 0.2)
    trainer = Trainer(SMALL, trainer_ctx)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="peer failed"), \
            CheckpointManager(trainer_ctx, trainer.state, upload_delay_s=3.0) as manager:
        assert manager.save(4)
        raise RuntimeError("peer failed")
    assert time.monotonic() - started < 2.0  # not the upload's 3 s
    with CheckpointManager(trainer_ctx, trainer.state, upload_delay_s=0.3) as manager:
        assert manager.save(8)
    assert manager.saves[-1].step == 8 and manager.saves[-1].ok  # drained on a clean exit
