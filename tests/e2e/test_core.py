"""End to end: real control plane, real agents on 127.0.0.2/3, real torchrun workers (gloo on CPU)."""

from __future__ import annotations

import psutil
import pytest

from tests.factories import job_body, steps_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


def _pids(cluster, job_id: str) -> list[int]:
    attempts = cluster.get(f"/v1/jobs/{job_id}/attempts")["items"]
    return [w["pid"] for a in attempts for n in a["nodes"] for w in n["workers"] if w["pid"]]


def _leased(cluster) -> list[str]:
    return [g["job_id"] for n in cluster.get("/v1/nodes") for g in n["gpus"] if g["job_id"]]


def test_two_node_tiny_gpt_succeeds_with_a_result(cluster):
    job = cluster.submit(job_body(args=["--steps", "120"]))
    done = cluster.wait_state(job["id"], {"succeeded", "failed", "cancelled"}, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    result = done["result"]
    assert len(result["weights_sha256"]) == 64 and result["world_size"] == 4 and result["steps"] == 120
    assert result["final_loss"] < result["initial_loss"]
    assert done["progress"]["step"] == 120
    # The measured split of the last logged steps (means over the 4 ranks) reached the job view.
    split = done["progress"]["metrics"]
    assert split["comm_bytes"] > 0 and 0 < split["comm_s"] <= split["step_s"]
    assert split["compute_s"] + split["comm_s"] == pytest.approx(split["step_s"])

    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert len(attempts) == 1, [a["end_reason"] for a in attempts]
    (attempt,) = attempts
    assert attempt["outcome"] == "succeeded"
    assert sorted(n["node_rank"] for n in attempt["nodes"]) == [0, 1]
    assert {n["node_name"] for n in attempt["nodes"]} == {"node-1", "node-2"}
    workers = [w for n in attempt["nodes"] for w in n["workers"]]
    assert sorted(w["rank"] for w in workers) == [0, 1, 2, 3]
    # A node's ranks are contiguous, in node-rank order (node_agent/part/commands.py).
    assert {n["node_rank"]: sorted(w["rank"] for w in n["workers"]) for n in attempt["nodes"]} == {0: [0, 1], 1: [2, 3]}
    assert all(w["exit_code"] == 0 and w["pid"] for w in workers)

    logs = cluster.http.get(f"/v1/jobs/{job['id']}/logs").text
    assert "weights_sha256" in logs  # rank 0's final JSON line reached the API
    assert cluster.wait_for("leases released", lambda: _leased(cluster) == [], timeout=15)
    kinds = [e["kind"] for e in cluster.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000})["items"]]
    assert kinds[:3] == ["job.queued", "job.starting", "attempt.allocated"] and "job.succeeded" in kinds


def test_cancel_stops_every_worker_and_releases_every_lease_within_15s(cluster):
    # Real processes under torchrun that take steps and train nothing: stopping them is the subject.
    job = cluster.submit(steps_body(1000000, 0.05))
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) > 3, timeout=120)
    pids = _pids(cluster, job["id"])
    assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids)

    r = cluster.http.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200 and r.json()["state"] in ("cancelling", "cancelled")
    done = cluster.wait_state(job["id"], {"cancelled"}, timeout=15)
    assert done["allocation"] == []

    def gone() -> bool:
        return not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    assert gone(), "workers still alive after the job was cancelled"
    assert _leased(cluster) == []


def test_gang_jobs_never_partially_allocated_and_second_waits_for_first(cluster):
    # Jobs that take steps and train nothing: allocation is the subject.
    big = cluster.submit(steps_body(150, 0.05, name="big"))
    small = cluster.submit(steps_body(20, 0.05, name="small", num_nodes=1, gpus_per_node=2))
    first_allocation: dict[str, int] = {}
    seen_big_running = False

    def gpus(j) -> int:
        return sum(len(a["gpu_indices"]) for a in j["allocation"])

    def observe() -> bool:
        nonlocal seen_big_running
        # small before big: leases only ever leave the big gang, so what the small job held when it
        # was read, it held beside at most what the big one still held a moment later.
        s = cluster.job(small["id"])
        b = cluster.job(big["id"])
        for j in (b, s):
            if gpus(j) and j["id"] not in first_allocation:
                first_allocation[j["id"]] = gpus(j)  # a gang is acquired whole, in one transaction
        # Leases are given back node by node as each node's processes are gone, so the small job
        # may start on a node the big one has left, but never beside a whole big gang.
        assert not (gpus(b) == 4 and gpus(s)), "small job allocated beside the whole big gang"
        if s["allocation"]:
            assert b["state"] in ENDED or gpus(b) < 4
        seen_big_running |= b["state"] == "running"
        return s["state"] in ENDED

    cluster.wait_for("small job done", observe, timeout=240, every=0.2)
    b = cluster.wait_state(big["id"], ENDED, timeout=60)
    s = cluster.job(small["id"])
    assert b["state"] == "succeeded" and s["state"] == "succeeded", (b["end_reason"], s["end_reason"])
    assert seen_big_running
    assert first_allocation == {big["id"]: 4, small["id"]: 2}
    kinds = [e["kind"] for e in cluster.get(f"/v1/jobs/{small['id']}/events")["items"]]
    assert kinds.index("job.starting") > 0
