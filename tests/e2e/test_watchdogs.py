"""Watchdogs end to end (issue 12): on a real cluster, one rank made slow is named a straggler with its
node; the platform sets the 'auto' checkpoint interval from what the saves cost; then one worker is
frozen (SIGSTOP) and its attempt is failed as hung, naming that rank, and recovered from the last
checkpoint to success, cold (the job is restartable, and a hang is never handed over to the next
attempt in process). Fast settings: an 8 s hang floor, a watchdog every 0.5 s."""

from __future__ import annotations

import os
import signal

import pytest

from tests.factories import job_body

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
SETTINGS = {
    "TRAINYARD_WATCHDOG_INTERVAL_S": "0.5",
    "TRAINYARD_HANG_TIMEOUT_MIN_S": "8",
    "TRAINYARD_STRAGGLER_PERSIST_S": "2",
    # A node failing every 36 s and a 2 s prior save: about 8 s between saves until one is measured.
    "TRAINYARD_FAILURE_PRIOR_NODE_MTBF_H": "0.01",
    "TRAINYARD_CHECKPOINT_AUTO_COST_PRIOR_S": "2",
    "TRAINYARD_CHECKPOINT_AUTO_MIN_S": "1",
}


def test_a_slow_rank_is_named_and_a_frozen_one_fails_its_attempt_as_hung(make_cluster):
    cluster = make_cluster(nodes=2, gpus_per_node=2, settings=SETTINGS)
    # Restartable (in-process restart, issue 30's fast path): a hang is never handed over, so its
    # recovery falls back to a cold restart of every rank.
    body = job_body(num_nodes=2, gpus_per_node=2, max_failures=2, restartable=True,
                    args=["--steps", "160", "--step-delay-s", "0.05", "--slow-rank", "3", "--slow-busy-s", "0.05",
                          "--restartable"],
                    checkpoint={"interval_steps": "auto", "first_interval_steps": 20})
    job = cluster.submit(body)
    jid = job["id"]
    named = cluster.wait_for("rank 3 named a straggler", lambda: cluster.events(jid, "attempt.straggler"), timeout=90)
    pids = cluster.worker_pids(jid)
    assert named[0]["data"]["rank"] == 3 and named[0]["data"]["node"] == pids[3][0]
    shown = cluster.wait_for("the straggler in the job view", lambda: cluster.job(jid)["stragglers"], timeout=10)
    assert (shown[0]["rank"], shown[0]["node"]) == (3, pids[3][0]) and shown[0]["ratio"] > 1.5

    chosen = cluster.wait_for("a measured interval", lambda: [e for e in cluster.events(jid, "checkpoint.interval")
                                                              if e["data"]["cost_measured"]], timeout=60)
    assert chosen[-1]["data"]["interval_steps"] >= 1 and chosen[-1]["data"]["cost_s"] < 5
    cluster.wait_for("a committed checkpoint", lambda: cluster.checkpoints(jid, "committed"), timeout=60)

    node, victim = pids[1]
    os.kill(victim, signal.SIGSTOP)  # the agent's SIGKILL ends it; the harness SIGCONTs what is left
    hung = cluster.wait_for("the attempt failed as hung", lambda: cluster.events(jid, "attempt.hung"), timeout=60)
    assert hung[0]["data"]["ranks"] == [1], hung[0]["message"]
    first = cluster.attempts(jid)[0]
    assert first["outcome"] == "failed" and first["end_reason"].startswith("hung: step")
    assert f"rank 1 on {node} stopped reporting" in first["end_reason"] and first["failed_node"] == node

    done = cluster.wait_state(jid, {"succeeded", "failed", "cancelled"}, timeout=240)
    assert done["state"] == "succeeded", done["end_reason"]
    attempts = cluster.attempts(jid)
    assert len(attempts) == 2 and attempts[1]["restored_from_step"] is not None
    # No rank kept its process through the hang: nothing handed over, every worker of attempt 2 new.
    assert not cluster.events(jid, "part.handed_over")
    pids_before = {pid for _node, pid in pids.values()}
    assert not pids_before & {w["pid"] for n in attempts[1]["nodes"] for w in n["workers"]}
    g = done["goodput"]
    assert g["recoveries"] == 1 and g["hung_s"] >= 8 and g["hung_gpu_s"] == pytest.approx(4 * g["hung_s"], rel=1e-3)
    metrics = cluster.http.get("/metrics").text
    assert 'trainyard_attempts_failed_total{cause="hung"} 1.0' in metrics
    assert 'trainyard_recovery_phase_seconds_count{phase="total"} 1.0' in metrics
