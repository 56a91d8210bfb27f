"""Recovery end to end: a SIGKILLed worker's job resumes from its last committed checkpoint and
ends with exactly the weights of a run that never failed."""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

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
    kinds = [e["kind"] for e in cluster.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000})["items"]]
    assert "checkpoint.committed" in kinds and "checkpoint.restored" in kinds and "job.recovering" in kinds

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
