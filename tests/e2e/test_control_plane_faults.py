"""The control plane dies under a running job, once at a random moment and once between writing a
checkpoint's manifest and committing it: training goes on, and every checkpoint is committed
exactly once."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.factories import job_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


def test_control_plane_restarts_never_stop_training_or_double_commit(make_cluster, reference_result):
    cluster = make_cluster(nodes=2)
    args = ["--steps", "120", "--step-delay-s", "0.1"]
    job = cluster.submit(job_body(name="cp-restart", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20}, max_failures=0))
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) >= 10, timeout=120)
    pids = cluster.worker_pids(job["id"])

    # 1. Killed mid-run and down for 3 s.
    cluster.dev.restart_control_plane(kill=True, down_s=3.0,
                                      extra_env={"TRAINYARD_FAILPOINTS": "checkpoint.before_commit=sleep(120)"})
    # 2. The new one stops inside the next commit (manifest written, row still pending): kill it there.
    cluster.wait_for("a commit paused at the failpoint", lambda: "failpoint hit" in cluster.log_text("control-plane"),
                     timeout=120, every=0.1)
    paused = {c["step"] for c in cluster.checkpoints(job["id"], "pending")}
    cluster.dev.restart_control_plane(kill=True)

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert len(attempts) == 1, [a["end_reason"] for a in attempts]  # the workers never stopped
    assert {rank: pid for rank, (_node, pid) in pids.items()} == {
        w["rank"]: w["pid"] for n in attempts[0]["nodes"] for w in n["workers"]}
    commits = Counter(e["data"]["step"] for e in cluster.events(job["id"], "checkpoint.committed"))
    assert commits == Counter({20: 1, 40: 1, 60: 1, 80: 1, 100: 1, 120: 1}), commits
    assert paused and paused <= set(commits)  # the interrupted commit was completed by the next process
    assert cluster.events(job["id"], "checkpoint.aborted") == []
    kept = cluster.checkpoints(job["id"], "committed")
    assert [c["step"] for c in kept] == [120, 100, 80]  # keep_last=3


def test_two_replicas_share_the_work_and_commit_each_checkpoint_once(make_cluster, reference_result):
    import httpx

    cluster = make_cluster(nodes=2, replicas=2)  # node-1 reports to replica 1, node-2 to replica 2
    second = httpx.Client(base_url=cluster.dev.config.replica_url(1), headers=dict(cluster.http.headers), timeout=30,
                          verify=cluster.verify)
    args = ["--steps", "80", "--step-delay-s", "0.05"]
    try:
        r = second.post("/v1/jobs", json=job_body(name="replicated", args=args, num_nodes=2, gpus_per_node=1,
                                                   checkpoint={"interval_steps": 10, "keep_last": 100},
                                                   max_failures=0))
        assert r.status_code == 201, r.text
        job = r.json()
        done = cluster.wait_state(job["id"], ENDED, timeout=180)
        assert done["state"] == "succeeded", done["end_reason"]
        assert second.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded"
    finally:
        second.close()
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    assert len(cluster.attempts(job["id"])) == 1
    # Both replicas ran the commit path (shard reports reach both; both run the maintenance loop).
    commits = Counter(e["data"]["step"] for e in cluster.events(job["id"], "checkpoint.committed"))
    assert commits == Counter({step: 1 for step in range(10, 81, 10)}), commits
    logs = cluster.log_text("control-plane") + cluster.log_text("control-plane-2")
    assert logs.count('"kind": "checkpoint.committed"') == 8
