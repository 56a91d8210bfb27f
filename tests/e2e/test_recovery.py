"""Recovery end to end: a SIGKILLed worker's job resumes from its last committed checkpoint and
ends with exactly the weights of a run that never failed. The cluster allows one checkpoint upload
at a time (TRAINYARD_UPLOAD_SLOTS_MAX=1): every shard waits for its slot, and no two uploads ever
hold one at once, also across the kill and the recovery."""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime

import pytest

from tests.factories import job_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}
ARGS = ["--steps", "80", "--step-delay-s", "0.05"]


def _worker_pids(cluster, job_id: str) -> dict[int, int]:
    attempts = cluster.get(f"/v1/jobs/{job_id}/attempts")["items"]
    current = attempts[-1]
    return {w["rank"]: w["pid"] for n in current["nodes"] for w in n["workers"]
            if w["pid"] and w["state"] == "running"}


def _committed(cluster, job_id: str) -> list[dict]:
    return [c for c in cluster.get(f"/v1/jobs/{job_id}/checkpoints")["items"] if c["state"] == "committed"]


def _max_concurrent(slots: list[dict]) -> int:
    """The most slots granted at once, from their recorded grant and end instants."""
    edges = []
    for s in slots:
        if s["granted_at"] is not None:
            end = datetime.fromisoformat(s["ended_at"]) if s["ended_at"] else datetime.max.replace(tzinfo=UTC)
            edges += [(datetime.fromisoformat(s["granted_at"]), 1), (end, -1)]
    held = peak = 0
    for _, delta in sorted(edges, key=lambda e: (e[0], e[1])):  # an end before a grant at one instant
        held += delta
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("cluster", [{"env": {"TRAINYARD_UPLOAD_SLOTS_MAX": "1"}}], indirect=True)
def test_sigkill_mid_run_resumes_exactly(cluster):
    body = job_body(args=ARGS, checkpoint={"interval_steps": 20}, num_nodes=2, gpus_per_node=2)  # 4 ranks
    clean = cluster.submit({**body, "name": "clean"})
    done = cluster.wait_state(clean["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]

    job = cluster.submit({**body, "name": "killed"})
    cluster.wait_for("a committed checkpoint", lambda: _committed(cluster, job["id"]), timeout=120)
    pids = cluster.wait_for("running workers", lambda: _worker_pids(cluster, job["id"]), timeout=30)
    victim = pids[max(pids)]
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()

    resumed = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert resumed["state"] == "succeeded", resumed["end_reason"]
    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert len(attempts) == 2 and attempts[0]["outcome"] == "failed"
    assert "exited with code -9" in attempts[0]["end_reason"]
    assert attempts[1]["restored_from_step"] is not None and attempts[1]["restored_from_step"] >= 20
    assert resumed["result"]["weights_sha256"] == done["result"]["weights_sha256"]
    events = cluster.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000})["items"]
    kinds = [e["kind"] for e in events]
    assert "checkpoint.committed" in kinds and "checkpoint.restored" in kinds and "job.recovering" in kinds
    # The in-memory tier served the restore: every agent lived, so every shard came from an agent's
    # memory (its own, or its peer's where torchrun put a rank on the other node), none from S3.
    restored = next(e for e in events if e["kind"] == "checkpoint.restored")
    tiers = restored["data"]["tiers"]
    assert sorted(r for ranks in tiers.values() for r in ranks) == [0, 1, 2, 3], restored
    assert "s3" not in tiers and tiers.get("local"), restored

    # Upload slots: every shard of a committed checkpoint was uploaded within one (or, after a bounded
    # wait, without one, which its checkpoint counts), and never two at once in the whole cluster.
    slots = [s for j in (clean, job) for s in cluster.get("/v1/upload-slots", params={"job_id": j["id"]})["slots"]]
    assert slots and cluster.get("/v1/upload-slots")["limits"]["max"] == 1
    assert _max_concurrent(slots) == 1
    assert all(s["state"] in ("released", "expired") for s in slots)  # none left open
    for j in (clean, job):
        for ckpt in _committed(cluster, j["id"]):
            upload = ckpt["upload"]
            assert upload is not None and upload["reported"] == ckpt["world_size"] == 4, ckpt
            granted = [s for s in slots if s["step"] == ckpt["step"] and s["attempt_id"] == ckpt["attempt_id"]
                       and s["ok"]]
            assert len(granted) + upload["bypassed"] == 4, (ckpt, granted)

    # Goodput (issue 12): the lost work and the downtime are what happened. The steps lost are those
    # the killed attempt reported past the checkpoint the new one restored; the downtime runs from
    # the kill (this process's clock; the control plane's is the same machine's) to the first new step.
    g = resumed["goodput"]
    first, second = attempts
    # Progress is reported every 10 steps: the steps lost are those reported past the restored one;
    # the time since the last report, up to the kill, is lost work too (lost_work_gpu_s below).
    assert g["recoveries"] == 1 and g["steps_lost"] == first["progress_step"] - second["restored_from_step"] >= 0
    assert g["steps_productive"] == 80
    first_new_step = datetime.fromisoformat(second["first_progress_at"]).timestamp()
    assert g["recovery_downtime_s"] == pytest.approx(second["recovery"]["to_first_step_s"], abs=0.01)
    assert g["recovery_downtime_s"] == pytest.approx(first_new_step - killed_at, abs=1.5)
    assert 0 < g["lost_work_gpu_s"] < g["allocated_gpu_s"] and g["recovery_gpu_s"] > 0
    assert g["checkpoint_stall_gpu_s"] > 0  # every rank reported what its saves blocked
    saved = _committed(cluster, job["id"])
    assert saved and all(c["blocking_s"] > 0 and c["upload_bytes_per_s"] > 0 for c in saved)
    parts = sum(g[f"{c}_gpu_s"] for c in ("productive", "checkpoint_stall", "lost_work", "recovery", "hung",
                                         "startup", "other"))
    assert parts == pytest.approx(g["allocated_gpu_s"], rel=1e-3) and 0 < g["goodput"] < 1
    assert done["goodput"]["recoveries"] == 0 and done["goodput"]["steps_lost"] == 0

    # Recovery as a budget: real agents report when they received the part and when their ranks'
    # process groups came up, so every phase is measured; the phases come in order (none negative)
    # and add up to the whole, which started at the kill.
    rec = second["recovery"]
    phases = [rec[f"{p}_s"] for p in ("detection", "decision", "wake_up", "process_start", "rendezvous", "restore")]
    assert all(s is not None and s >= 0 for s in phases), rec
    assert sum(phases) == pytest.approx(rec["to_first_step_s"], abs=0.002)
    assert datetime.fromisoformat(rec["failure_at"]).timestamp() == pytest.approx(killed_at, abs=1.5)
    assert rec["budget_s"]["wake_up"] > 0 and isinstance(rec["over_budget"], list)
