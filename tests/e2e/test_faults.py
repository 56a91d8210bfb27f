"""Recovery from real faults in real processes: a node dies, a node freezes and comes back stale, a
worker dies mid-checkpoint, a committed shard rots, S3 goes away, the control plane restarts
(also in the middle of a commit), a job fails for good. Each run must end exactly where an
unbroken run ends: the same weights_sha256 as tiny_gpt under bare torchrun."""

from __future__ import annotations

import json
import signal
from urllib.parse import urlsplit

import pytest

from tests.e2e.harness import LiveCluster
from tests.factories import job_body

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ENDED = {"succeeded", "failed", "cancelled"}
ARGS = ["--steps", "80", "--step-delay-s", "0.05"]


def _submit(cluster: LiveCluster, name: str, args: list[str] = ARGS, **overrides) -> dict:
    body = job_body(name=name, args=args, num_nodes=2, gpus_per_node=1, checkpoint={"interval_steps": 20},
                    max_failures=3)
    body.update(overrides)
    return cluster.submit(body)


def _leases(cluster: LiveCluster) -> dict[str, str | None]:
    """node name -> the job holding its (single) GPU, or None."""
    return {n["name"]: n["gpus"][0]["job_id"] for n in cluster.get("/v1/nodes")}


def _nodes_of(attempt: dict) -> set[str]:
    return {n["node_name"] for n in attempt["nodes"]}


def test_node_killed_with_its_workers_job_recovers_on_other_nodes(make_cluster, reference_result):
    cluster = make_cluster(nodes=3)
    job = _submit(cluster, "node-loss")
    cluster.wait_for("a committed checkpoint", lambda: cluster.checkpoints(job["id"], "committed"), timeout=120)
    first = cluster.attempts(job["id"])[0]
    victim = next(n["node_name"] for n in first["nodes"] if n["node_rank"] == 0)  # the rendezvous host
    killed = cluster.signal_node(victim, signal.SIGKILL)
    assert len(killed) >= 3  # the agent, torchrun, at least one worker

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(ARGS)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "succeeded"]
    assert attempts[0]["failed_node"] == victim and "lost" in attempts[0]["end_reason"]
    assert victim not in _nodes_of(attempts[1])
    survivor = (_nodes_of(attempts[0]) - {victim}).pop()
    assert survivor in _nodes_of(attempts[1])  # recovery keeps the healthy node, replaces the dead one
    recovery = attempts[1]["recovery"]
    assert attempts[1]["restored_from_step"] >= 20 and recovery["steps_lost"] is not None
    assert 0 < recovery["to_first_step_s"] < 120
    # The in-memory tier: the dead node's memory went with it, but its shards have a copy on a peer
    # (another live agent), so the replacement restores every rank from memory, none from S3.
    restored = [e for e in cluster.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000})["items"]
                if e["kind"] == "checkpoint.restored"]
    assert len(restored) == 1 and "s3" not in restored[0]["data"]["tiers"], restored

    # The lost node's GPU stays leased to the dead attempt: nobody gets it until an operator
    # vouches that its processes are gone by removing the node.
    assert cluster.node(victim)["state"] == "lost"
    assert _leases(cluster)[victim] == job["id"]
    assert attempts[0]["state"] == "stopping"
    r = cluster.http.delete(f"/v1/nodes/{cluster.node_id(victim)}")
    assert r.status_code == 200 and r.json()["state"] == "removed", r.text
    assert victim not in _leases(cluster)
    assert cluster.attempts(job["id"])[0]["state"] == "ended"
    assert cluster.http.delete(f"/v1/nodes/{r.json()['id']}").status_code == 404


def test_a_node_lost_with_the_peer_holding_its_memory_copy_restores_from_s3(make_cluster, reference_result):
    """Issue 14: the in-memory tier is an accelerator, never the source of truth. A one-node job's
    node dies together with the peer agent that keeps the copy of its shards: both memory tiers are
    gone, and the job resumes on the third node from S3 with the weights of an unbroken run."""
    cluster = make_cluster(nodes=3, gpus_per_node=2)
    job = _submit(cluster, "peer-lost", num_nodes=1, gpus_per_node=2)
    cluster.wait_for("a committed checkpoint", lambda: cluster.checkpoints(job["id"], "committed"), timeout=120)
    first = cluster.attempts(job["id"])[0]
    (victim,) = _nodes_of(first)
    state = cluster.dev.config.data_dir / "nodes" / victim / "attempts" / first["id"] / "state.json"
    peer_host = urlsplit(json.loads(state.read_text())["spec"]["memory"]["peer_url"]).hostname
    (peer,) = [n["name"] for n in cluster.get("/v1/nodes") if n["address"] == peer_host]
    assert peer != victim
    for name in (peer, victim):
        cluster.signal_node(name, signal.SIGKILL)

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(ARGS)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert _nodes_of(attempts[-1]) == {"node-1", "node-2", "node-3"} - {victim, peer}
    restored = cluster.events(job["id"], "checkpoint.restored")
    assert len(restored) == 1 and set(restored[0]["data"]["tiers"]) == {"s3"}, restored


def test_frozen_node_comes_back_stale_and_changes_nothing(make_cluster, reference_result):
    cluster = make_cluster(nodes=3)
    # Rank 1 sleeps between uploading a shard and reporting it, so the node can be frozen with a
    # shard of step 40 uploaded but not reported: reported after the thaw, it must be refused.
    args = [*ARGS, "--ckpt-upload-delay-s", "3", "--ckpt-slow-rank", "1"]
    job = _submit(cluster, "frozen", args)

    def half_reported_step_40() -> bool:
        states = {(c["step"], c["state"], c["shards"]) for c in cluster.checkpoints(job["id"])}
        return (20, "committed", 2) in states and (40, "pending", 1) in states
    cluster.wait_for("step 20 committed, step 40 half reported", half_reported_step_40, timeout=120, every=0.1)
    rank1_node, _pid = cluster.worker_pids(job["id"])[1]
    old = cluster.attempts(job["id"])[0]
    frozen = cluster.signal_node(rank1_node, signal.SIGSTOP)

    cluster.wait_for("recovery elsewhere", lambda: len(cluster.attempts(job["id"])) == 2
                     and cluster.job(job["id"])["state"] == "running", timeout=90)
    assert cluster.node(rank1_node)["state"] == "lost"
    assert _leases(cluster)[rank1_node] == job["id"]  # held by the stale attempt, given to nobody
    new = cluster.attempts(job["id"])[1]
    assert rank1_node not in _nodes_of(new)

    for p in frozen:
        p.send_signal(signal.SIGCONT)
    cluster.wait_for("the stale attempt's GPU back", lambda: _leases(cluster)[rank1_node] is None, timeout=60)
    assert cluster.attempts(job["id"])[0]["state"] == "ended"
    node_log = cluster.log_text(rank1_node)
    assert "attempt_stale" in node_log and old["id"] in node_log

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert len(attempts) == 2 and attempts[1]["outcome"] == "succeeded"
    # The late shard never completed the old attempt's checkpoint of step 40.
    old_40 = [c for c in cluster.checkpoints(job["id"]) if c["attempt_number"] == 1 and c["step"] == 40]
    assert [c["state"] for c in old_40] == ["aborted"] and old_40[0]["shards"] == 1
    old_commits = [e["data"]["step"] for e in cluster.events(job["id"], "checkpoint.committed")
                   if e["attempt_id"] == old["id"]]
    assert old_commits == [20]
    released = [e for e in cluster.events(job["id"], "leases.released") if e["attempt_id"] == old["id"]]
    assert {e["node_id"] for e in released} == {n["node_id"] for n in old["nodes"]}
