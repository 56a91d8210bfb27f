"""Recovery end to end: a SIGKILLed worker's job resumes from its last committed checkpoint and
ends with exactly the weights of a run that never failed. The cluster allows one checkpoint upload
at a time (TRAINYARD_UPLOAD_SLOTS_MAX=1): every shard waits for its slot, and no two uploads ever
hold one at once, also across the kill and the recovery."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

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
@pytest.mark.standbys  # its recovery forks warm (tests/conftest.py)
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


STALE_JOIN = """
import json, sys
from datetime import timedelta
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import StaleRendezvousError, fenced_store
from trainyard.protocol.restart import Rendezvous
attempt_id, token, host, port = sys.argv[1:5]
env = {"TRAINYARD_ATTEMPT_ID": attempt_id, "TRAINYARD_FENCING_TOKEN": token, "RANK": "1", "WORLD_SIZE": "2",
       "TRAINYARD_RENDEZVOUS": Rendezvous(host=host, port=int(port)).to_env()}
ctx = WorkerContext.from_env(env)
try:
    fenced_store(ctx, timeout=timedelta(seconds=20))
except StaleRendezvousError as exc:
    print("REFUSED", exc)
    sys.exit(7)
print("JOINED")
"""


@pytest.mark.parametrize("cluster", [{"nodes": 2, "gpus_per_node": 1}], indirect=True)
def test_a_restartable_job_keeps_its_healthy_rank_in_process_and_refuses_a_stale_one(cluster):
    """Issue 14, in-process restart under real agents: node B's rank is SIGKILLed; node A's worker is
    parked, handed over to the next attempt on the same GPU and restarts in process (same pid), B's
    rank starts fresh, the weights equal an unfailed run's, and a worker holding the failed attempt's
    token cannot join the new attempt's rendezvous."""
    body = job_body(entrypoint="tests/e2e/restartable_job.py", args=["250", "0.04"], num_nodes=2, gpus_per_node=1,
                    checkpoint={"interval_steps": 10}, restartable=True)
    clean = cluster.submit({**body, "name": "clean", "restartable": False})
    done = cluster.wait_state(clean["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]

    job = cluster.submit({**body, "name": "killed"})
    cluster.wait_for("a committed checkpoint", lambda: _committed(cluster, job["id"]), timeout=120)
    first = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"][-1]
    pids = {n["node_name"]: [w["pid"] for w in n["workers"]] for n in first["nodes"]}
    (node_a,) = [n["node_name"] for n in first["nodes"] if n["node_rank"] == 0]
    (node_b,) = [n["node_name"] for n in first["nodes"] if n["node_rank"] == 1]
    os.kill(pids[node_b][0], signal.SIGKILL)

    def second_attempt() -> dict | None:
        items = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
        return items[-1] if len(items) == 2 and items[-1]["progress_step"] is not None else None

    second = cluster.wait_for("the next attempt's first step", second_attempt, timeout=120)
    # A worker of the failed attempt that learned the new rendezvous holds only the old token.
    state = next(Path(cluster.log.parent, "cluster").glob(f"nodes/{node_a}/attempts/{first['id']}/state.json"))
    old_token = json.loads(state.read_text())["spec"]["fencing_token"]
    host, port = second["rendezvous"].rsplit(":", 1)
    stale = subprocess.run([sys.executable, "-c", STALE_JOIN, first["id"], old_token, host, port],
                           capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert stale.returncode == 7 and "REFUSED" in stale.stdout, stale.stdout + stale.stderr[-2000:]

    resumed = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert resumed["state"] == "succeeded", resumed["end_reason"]
    assert resumed["result"]["weights_sha256"] == done["result"]["weights_sha256"]
    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert len(attempts) == 2 and attempts[0]["outcome"] == "failed"
    later = {n["node_name"]: [w["pid"] for w in n["workers"]] for n in attempts[1]["nodes"]}
    assert later[node_a] == pids[node_a]  # the same process, restarted in place
    assert later[node_b] != pids[node_b]  # the replaced rank started fresh
    by_pid = {r["pid"]: r for r in resumed["result"]["ranks"]}
    assert by_pid[pids[node_a][0]]["restarts"] == 1
    assert [r["restarts"] for r in resumed["result"]["ranks"] if r["pid"] != pids[node_a][0]] == [0]
    kinds = [e["kind"] for e in cluster.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000})["items"]]
    assert "part.parked" in kinds and "part.handed_over" in kinds and "leases.handed_over" in kinds
