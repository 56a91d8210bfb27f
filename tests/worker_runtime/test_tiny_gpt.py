from __future__ import annotations

import io
import json

import torch

from tests.conftest import S3Bucket
from tests.helpers import ProcessReaper
from tests.worker_runtime.fake_agent import manifest_from_shards, serve_fake_agent
from tests.worker_runtime.torchrun import run_torchrun
from trainyard.protocol.layout import METRIC_COMM_BYTES, METRIC_COMM_S, METRIC_COMPUTE_S, METRIC_STEP_S
from trainyard.storage.s3 import S3Config, S3Storage
from worker_runtime import Reporter, WorkerContext
from worker_runtime.examples.tiny_gpt import Config, Trainer

TINY_GPT_20 = ["worker_runtime.examples.tiny_gpt", "--steps", "20", "--log-every", "5"]
SMALL = Config(steps=12, batch_size=4, seq_len=16, d_model=32, layers=1, heads=2, log_every=4)


def _standalone() -> WorkerContext:
    return WorkerContext(device="cpu")


def test_batches_depend_only_on_step_and_rank() -> None:
    def batch(rank: int, world: int, step: int) -> torch.Tensor:
        trainer = Trainer(SMALL, WorkerContext(device="cpu", rank=rank, world_size=world, local_world_size=world))
        trainer.position.offset = step
        return trainer.batches.next(torch.device("cpu"))[0]

    assert torch.equal(batch(1, 2, 5), batch(1, 2, 5))
    assert not torch.equal(batch(0, 2, 5), batch(1, 2, 5))  # disjoint slices of one global batch
    assert not torch.equal(batch(0, 2, 5), batch(0, 2, 6))
    # One global stream, sliced by (step, rank): rank 1 of 2 at step 0 reads what a single rank
    # reads at step 1.
    assert torch.equal(batch(1, 2, 0), batch(0, 1, 1))


def test_resuming_from_saved_state_is_bit_identical() -> None:
    with Reporter(_standalone(), echo=False) as reporter:
        uninterrupted = Trainer(SMALL, _standalone()).fit(reporter)
        first = Trainer(SMALL, _standalone())
        assert first.fit(reporter, until=5) is not None
        buffer = io.BytesIO()
        torch.save(first.state.state_dict(), buffer)  # what a checkpoint will hold
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        torch.manual_seed(1234)  # the resumed process starts with other RNG state
        resumed = Trainer(SMALL, _standalone())
        resumed.state.load_state_dict(saved)
        result = resumed.fit(reporter)
    assert uninterrupted is not None and result is not None
    assert result["steps"] == uninterrupted["steps"] == SMALL.steps
    assert result["weights_sha256"] == uninterrupted["weights_sha256"]
    assert result["final_loss"] == uninterrupted["final_loss"]


def test_torchrun_is_deterministic_and_learns(process_reaper: ProcessReaper) -> None:
    with serve_fake_agent() as agent:
        managed_env = {
            "TRAINYARD_AGENT_URL": agent.url,
            "TRAINYARD_ATTEMPT_ID": "att-7",
            "TRAINYARD_FENCING_TOKEN": "tok-7",
            "TRAINYARD_DEVICE": "cpu",
        }
        first, stdout = run_torchrun(process_reaper, TINY_GPT_20, managed_env)
        progress = [r.body for r in agent.of("progress")]
        results = [r.body for r in agent.of("result")]
    second, _ = run_torchrun(process_reaper, TINY_GPT_20, {"TRAINYARD_DEVICE": "cpu"})

    assert set(first) >= {"final_loss", "weights_sha256", "steps", "world_size"}
    assert (first["steps"], first["world_size"]) == (20, 2)
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first["final_loss"] < first["initial_loss"] - 0.3, stdout
    # Through the agent: the loss from rank 0 only (every rank reports its step and timings, for the
    # watchdogs), then rank 0's result, the same as printed.
    assert progress and {p["rank"] for p in progress if p["loss"] is not None} == {0}
    assert {p["rank"] for p in progress} == {0, 1} and progress[-1]["step"] == 20
    assert all(p["busy_s"] > 0 for p in progress if p["step"] > 1 and p["step_time_s"] is not None)
    assert all(p["fencing_token"] == "tok-7" for p in progress)
    # The measured split of every window rank 0 reported: compute + exposed communication = the
    # step, and the gradients' all-reduce passed bytes (the other ranks send no metrics).
    assert all(p["metrics"] == {} for p in progress if p["rank"] != 0)
    for p in (p for p in progress if p["rank"] == 0):
        m = p["metrics"]
        assert {METRIC_STEP_S, METRIC_COMPUTE_S, METRIC_COMM_S, METRIC_COMM_BYTES} <= set(m), m
        assert m[METRIC_STEP_S] > 0 and 0 <= m[METRIC_COMM_S] <= m[METRIC_STEP_S]
        assert abs(m[METRIC_COMPUTE_S] + m[METRIC_COMM_S] - m[METRIC_STEP_S]) < 1e-6
        assert m[METRIC_COMM_BYTES] > 0
    assert results == [{"fencing_token": "tok-7", "rank": 0, "result": first}]


FOUR_RANK_LAYOUTS: dict[str, dict[str, object] | None] = {
    "ddp": None,  # plain DDP
    # FSDP2 over 2 replicas x 2 shards (DTensor state saved and loaded per rank), no sync on the
    # first micro-step.
    "hsdp-accum": {"kind": "hsdp", "shard_size": 2, "grad_accum_steps": 2},
    # DDP's no_sync, and PowerSGD's error feedback, factors and RNG saved per rank.
    "ddp-powersgd-accum": {"kind": "ddp", "compression": "powersgd", "grad_accum_steps": 2},
}


def test_resume_is_bit_identical_with_four_ranks_under_each_layout(process_reaper: ProcessReaper) -> None:
    # With more than two ranks the order of the all-reduce sums matters: a resumed process must
    # reduce its first step in the same bucket layout as the uninterrupted one (settle_ddp_buckets).
    # Every layout in one launch: four torch workers cost about 15 CPU-s to start.
    env = {"DDP_RESUME_LAYOUTS": json.dumps(FOUR_RANK_LAYOUTS)}
    out, stdout = run_torchrun(process_reaper, ["tests.worker_runtime.ddp_resume_worker"], env, nproc=4)
    assert sorted(out) == sorted(FOUR_RANK_LAYOUTS), stdout
    for name, layout in FOUR_RANK_LAYOUTS.items():
        resumed, uninterrupted, applied = out[name]["resumed"], out[name]["uninterrupted"], out[name]["applied"]
        assert resumed["weights_sha256"] == uninterrupted["weights_sha256"], name
        assert resumed["final_loss"] == uninterrupted["final_loss"], name
        assert (resumed["steps"], resumed["world_size"]) == (12, 4), name
        kind = (layout or {}).get("kind", "ddp")
        if kind == "hsdp":  # each rank holds half of every parameter (a shard group of 2)
            assert applied["local_numel"] < applied["numel"] * 0.6 and applied["wrapper"] == "FSDPTinyGPT", name
        else:
            assert applied["local_numel"] == applied["numel"] and applied["wrapper"] == "DistributedDataParallel"
        assert ("powersgd" in applied["state"]) == ((layout or {}).get("compression") == "powersgd"), name
    # The layouts differ in what each one's uninterrupted run ends with (sharding changes the sums).
    assert len({out[name]["uninterrupted"]["weights_sha256"] for name in FOUR_RANK_LAYOUTS}) >= 2


def test_torchrun_resumes_from_s3_checkpoints_bit_identical(process_reaper: ProcessReaper, s3_bucket: S3Bucket) -> None:
    job = "job-resume"
    with serve_fake_agent() as agent:
        env = {
            "TRAINYARD_AGENT_URL": agent.url,
            "TRAINYARD_DEVICE": "cpu",
            "TRAINYARD_JOB_ID": job,
            "TRAINYARD_CHECKPOINT": json.dumps({"interval_steps": 5, "keep_last": 3}),
            "TRAINYARD_S3_ENDPOINT": s3_bucket.endpoint,
            "TRAINYARD_S3_ACCESS_KEY": s3_bucket.access_key,
            "TRAINYARD_S3_SECRET_KEY": s3_bucket.secret_key,
            "TRAINYARD_S3_BUCKET": s3_bucket.bucket,
            "TRAINYARD_S3_SECURE": "0",
            "TRAINYARD_CHECKPOINT_PREFIX": f"jobs/{job}/checkpoints",
        }
        attempt0 = {"TRAINYARD_ATTEMPT_ID": "att-0", "TRAINYARD_ATTEMPT_NUMBER": "0", "TRAINYARD_FENCING_TOKEN": "t0"}
        first, _ = run_torchrun(process_reaper, TINY_GPT_20, {**env, **attempt0})
        shards = agent.shards()
        manifests = {step: manifest_from_shards(shards, job_id=job, attempt_id="att-0", attempt_number=0,
                                                step=step, world_size=2) for step in (10, 15)}
        # Rank 1's shard of step 15 is damaged, rank 0's is fine: every rank must still agree to
        # fall back to step 10 together.
        store = S3Storage(S3Config(endpoint=s3_bucket.endpoint, bucket=s3_bucket.bucket,
                                   access_key=s3_bucket.access_key, secret_key=s3_bucket.secret_key))
        key = manifests[15]["shards"][1]["key"]
        store.put_bytes(key, store.get_bytes(key)[::-1])
        plan = {"candidates": [manifests[15], manifests[10]]}
        attempt1 = {"TRAINYARD_ATTEMPT_ID": "att-1", "TRAINYARD_ATTEMPT_NUMBER": "1", "TRAINYARD_FENCING_TOKEN": "t1",
                    "TRAINYARD_RESTORE_FROM": json.dumps(plan)}
        resumed, stdout = run_torchrun(process_reaper, TINY_GPT_20, {**env, **attempt1})
        events = [r.body for r in agent.of("events")]

    assert sorted((s["step"], s["rank"]) for s in shards) == [(st, r) for st in (5, 10, 15, 20) for r in (0, 1)]
    sizes = {(s["step"], s["rank"]): s["size_bytes"] for s in shards}
    assert all(sizes[step, 1] < sizes[step, 0] / 4 for step in (5, 10, 15, 20)), sizes  # weights: rank 0's only
    assert first["checkpoints_saved"] == 4 and first["restored_from_step"] is None
    assert resumed["restored_from_step"] == 10, stdout
    assert resumed["weights_sha256"] == first["weights_sha256"]
    assert resumed["final_loss"] == first["final_loss"]
    # The restore's events (an upload without a slot, `checkpoint.upload_unslotted`, may come too on a
    # loaded machine: the next save was due before the slot's answer; CI, stop 34).
    events = [e for e in events if e["kind"] in ("checkpoint.fallback", "checkpoint.restored")]
    assert [(e["kind"], e["rank"], e["data"]["step"]) for e in events] == [
        ("checkpoint.fallback", 0, 15), ("checkpoint.restored", 0, 10)]
    assert events[0]["data"]["reason"] == "rank 1: shard sha256 differs from the manifest"
