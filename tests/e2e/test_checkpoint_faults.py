"""Checkpoints under real faults: a worker killed between upload and report, a committed shard
corrupted in S3, S3 cut off for a while, a job that keeps failing. Nothing partial is ever
committed, restores fall back with a reason, and every run that succeeds ends with the weights of
a run that never failed."""

from __future__ import annotations

import io
import os
import signal

import pytest

from tests.e2e.harness import LiveCluster
from tests.factories import job_body

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ENDED = {"succeeded", "failed", "cancelled"}
ARGS = ["--steps", "80", "--step-delay-s", "0.05"]


def _submit(cluster: LiveCluster, name: str, args: list[str], **overrides) -> dict:
    body = job_body(name=name, args=args, num_nodes=2, gpus_per_node=1, checkpoint={"interval_steps": 20},
                    max_failures=3)
    body.update(overrides)
    return cluster.submit(body)


def _states(cluster: LiveCluster, job_id: str) -> set[tuple[int, str, int]]:
    return {(c["step"], c["state"], c["shards"]) for c in cluster.checkpoints(job_id)}


def test_worker_killed_mid_checkpoint_never_commits_it(make_cluster, reference_result):
    cluster = make_cluster(nodes=2)
    # Rank 1 reports each shard 3 s after uploading it: a window with step 40 half reported.
    args = [*ARGS, "--ckpt-upload-delay-s", "3", "--ckpt-slow-rank", "1"]
    job = _submit(cluster, "mid-checkpoint", args)
    cluster.wait_for("step 20 committed and step 40 half reported",
                     lambda: {(20, "committed", 2), (40, "pending", 1)} <= _states(cluster, job["id"]),
                     timeout=120, every=0.1)
    _node, pid = cluster.worker_pids(job["id"])[1]
    os.kill(pid, signal.SIGKILL)

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "succeeded"]
    assert attempts[1]["restored_from_step"] == 20  # the one before the partial checkpoint
    partial = [c for c in cluster.checkpoints(job["id"]) if c["attempt_number"] == 1 and c["step"] == 40]
    assert [(c["state"], c["shards"]) for c in partial] == [("aborted", 1)]
    # Aborted once attempt 1 ended, or before that, once attempt 2 (passed attempt 1's GPUs while its
    # processes stopped: services/runs/handover.py) became the job's current one: it can never commit.
    assert partial[0]["reason"] in ("attempt 1 ended before all shards arrived",
                                    "attempt 1 failed before all shards arrived"), partial[0]["reason"]
    aborted = [e for e in cluster.events(job["id"], "checkpoint.aborted") if e["data"]["step"] == 40]
    assert aborted and aborted[0]["attempt_id"] == attempts[0]["id"]


def test_corrupt_committed_shard_is_detected_and_restore_falls_back(make_cluster, reference_result, monkeypatch):
    # S3 alone: the in-memory tier would serve the right bytes of step 40 and never read the rotten ones.
    monkeypatch.setenv("TRAINYARD_AGENT_MEMORY_TIER_MB", "0")
    cluster = make_cluster(nodes=2)
    args = ["--steps", "80", "--step-delay-s", "0.1"]
    job = _submit(cluster, "corrupt", args)
    step_40 = cluster.wait_for("step 40 committed", lambda: [
        c for c in cluster.checkpoints(job["id"], "committed") if c["step"] == 40], timeout=120, every=0.1)[0]
    _node, pid = cluster.worker_pids(job["id"])[1]
    # Same size, other bytes: only the sha256 can tell.
    client = _client(cluster)
    key = step_40["manifest_key"].rsplit("/", 1)[0] + "/rank-00000.pt"
    size = client.stat_object(cluster.s3.bucket, key).size
    client.put_object(cluster.s3.bucket, key, io.BytesIO(b"\0" * size), size)
    os.kill(pid, signal.SIGKILL)

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert len(attempts) == 2 and attempts[1]["restored_from_step"] == 20
    fallback = cluster.events(job["id"], "checkpoint.fallback")
    assert fallback and fallback[0]["data"]["step"] == 40 and "sha256" in fallback[0]["message"]
    assert "rank 1: rank 0's shard, which holds the replicated state" in fallback[0]["message"]
    assert fallback[0]["attempt_id"] == attempts[1]["id"]
    restored = cluster.events(job["id"], "checkpoint.restored")
    assert [e["data"]["step"] for e in restored] == [20]
    # The bad checkpoint is demoted: no later restore plan names it.
    [demoted] = cluster.checkpoints(job["id"], "unusable")
    assert demoted["id"] == step_40["id"] and "sha256" in demoted["reason"], demoted


def _client(cluster: LiveCluster):
    from minio import Minio

    return Minio(cluster.s3.endpoint, access_key=cluster.s3.access_key, secret_key=cluster.s3.secret_key,
                 secure=False)


def test_s3_outage_aborts_those_checkpoints_and_training_goes_on(make_cluster, reference_result):
    cluster = make_cluster(nodes=2, proxy_s3=True)
    args = ["--steps", "120", "--step-delay-s", "0.05"]
    job = _submit(cluster, "s3-outage", args)
    cluster.wait_for("step 20 committed", lambda: cluster.checkpoints(job["id"], "committed"), timeout=120)
    assert cluster.s3_proxy is not None
    cluster.s3_proxy.cut()
    failed_saves = cluster.wait_for("a checkpoint aborted because a rank could not save", lambda: [
        e for e in cluster.events(job["id"], "checkpoint.aborted") if "could not save" in e["message"]],
        timeout=60, every=0.2)
    cut_step = failed_saves[0]["data"]["step"]
    assert cluster.job(job["id"])["state"] == "running"
    cluster.s3_proxy.restore()

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    assert len(cluster.attempts(job["id"])) == 1  # training never stopped
    committed = sorted(c["step"] for c in cluster.checkpoints(job["id"], "committed"))
    assert committed and committed[-1] == 120 and cut_step not in committed
    assert cut_step > 20


def test_max_failures_exhausted_fails_the_job_with_every_reason(make_cluster):
    cluster = make_cluster(nodes=2)
    args = ["--steps", "50", "--crash-at-step", "5", "--crash-rank", "1"]
    job = _submit(cluster, "doomed", args, max_failures=1, checkpoint={})

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "failed"
    assert "2 failed attempts exceed max_failures=1" in done["end_reason"]
    assert done["end_reason"].count("exited with code 3") == 2
    assert "attempt 1:" in done["end_reason"] and "attempt 2:" in done["end_reason"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "failed"]
    cluster.wait_for("every lease released", lambda: all(
        g["job_id"] is None for n in cluster.get("/v1/nodes") for g in n["gpus"]), timeout=30)
    cluster.wait_for(lambda: f"both attempts ended: {cluster.attempts(job['id'])}", lambda: all(
        a["state"] == "ended" for a in cluster.attempts(job["id"])), timeout=30)
    failed = cluster.events(job["id"], "job.failed")
    assert len(failed) == 1 and len(failed[0]["data"]["reasons"]) == 2
