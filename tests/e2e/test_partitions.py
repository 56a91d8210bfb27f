"""Faults between processes that all stay up: a node cut from its peer one way, then from the control
plane, on a real network (each node in a network namespace of its own, trainyard/dev/netns.py), and PostgreSQL
restarted under a running job and in the middle of a commit. Every run ends with the weights of a
run that never failed."""

from __future__ import annotations

import os
import signal
from collections import Counter

import pytest

from tests.e2e.harness import LiveCluster
from tests.factories import job_body
from tests.helpers import need
from trainyard.dev.netns import Shape, Topology, parse_rate
from trainyard.embedded import EmbeddedPostgres

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]  # recoveries: later attempts fork warm (tests/conftest.py)
ENDED = {"succeeded", "failed", "cancelled"}


def _held_by(cluster: LiveCluster, node: str) -> set[str | None]:
    return {g["attempt_id"] for g in cluster.node(node)["gpus"]}


# Two racks on real links (trainyard/dev/netns.py): node-1 and node-2 in rack r1, node-3 in r2.
RACKS = Topology(racks=2, node_link=Shape(parse_rate("1gbit")), rack_uplink=Shape(parse_rate("200mbit")))


def test_a_node_cut_from_its_peer_then_from_the_control_plane_each_ends_its_attempt_and_the_job_recovers(
        make_cluster, reference_result):
    """Each node in a network namespace of its own, on real links. One job, two cuts:

    1. One way between the gang's two nodes: what node-2 sends to node-1 is dropped (a blackhole
       route in node-2's namespace), everything else flows. Both agents keep heartbeating, so no node
       is lost; the collectives stall, and the hang watchdog fails the attempt. Healed, the job goes on.
    2. The node of rank 1 cut from the host side (the control plane and S3) both ways, while its
       workers still reach the other node's: the node is lost, the job recovers elsewhere, and after
       the heal the stale workers stop before its GPU is free again.

    The job ends with the weights of a run that never failed."""
    need(os.geteuid() == 0, "network namespaces need root (CI runs as root)")
    cluster = make_cluster(nodes=3, network=RACKS, settings={
        "TRAINYARD_WATCHDOG_INTERVAL_S": "0.5", "TRAINYARD_HANG_TIMEOUT_MIN_S": "10"})
    network = cluster.dev.network
    assert network is not None
    nodes = {n["name"]: n for n in cluster.get("/v1/nodes")}
    assert {name: (n["address"], n["labels"].get("rack")) for name, n in nodes.items()} == {
        f"node-{i}": (network.layout.node_address(i), f"r{network.layout.rack_of(i)}") for i in (1, 2, 3)}
    args = ["--steps", "160", "--step-delay-s", "0.05"]
    job = cluster.submit(job_body(name="partition", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20}, max_failures=3,
                                  watchdog={"hang_timeout_s": 10}))
    cluster.wait_for("a committed checkpoint", lambda: cluster.checkpoints(job["id"], "committed"), timeout=120)
    first = cluster.attempts(job["id"])[0]
    assert {n["node_name"] for n in first["nodes"]} == {"node-1", "node-2"}  # the gang kept inside rack r1

    # 1. One way, node-2 -> node-1.
    network.cut(2, peer=1, direction="out")
    try:
        ended = cluster.wait_for("attempt 1 failed", lambda: [a for a in cluster.attempts(job["id"])
                                                              if a["id"] == first["id"] and a["outcome"]], timeout=90)
        # No node was lost: each still reaches the control plane; only the path between them is cut.
        assert {n["name"]: n["state"] for n in cluster.get("/v1/nodes")} == {f"node-{i}": "ready" for i in (1, 2, 3)}
    finally:
        network.heal()
    assert ended[0]["outcome"] == "failed" and ended[0]["end_reason"].startswith("hung: step"), ended[0]
    second = cluster.wait_for("attempt 2 past its restored step", lambda: [
        a for a in cluster.attempts(job["id"])[1:] if a["restored_from_step"] is not None
        and (a["progress_step"] or 0) > a["restored_from_step"] + 5], timeout=120)[0]

    # 2. The node of rank 1 cut from the host, both ways.
    victim = next(n["node_name"] for n in second["nodes"] if n["node_rank"] == 1)
    network.cut(int(victim.rsplit("-", 1)[1]))
    try:
        lost = cluster.wait_for(f"{victim} lost", lambda: cluster.node(victim)["state"] == "lost", timeout=60)
        assert lost
        done = cluster.wait_state(job["id"], ENDED, timeout=240)
        assert done["state"] == "succeeded", done["end_reason"]
        # While it is cut off, the lost node's GPU stays leased to the attempt that ran there: its
        # workers may still run for all the control plane knows.
        assert _held_by(cluster, victim) == {second["id"]}
    finally:
        network.heal()

    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "failed", "succeeded"], [a["end_reason"] for a in attempts]
    assert attempts[1]["failed_node"] == victim and "lost" in attempts[1]["end_reason"]
    assert victim not in {n["node_name"] for n in attempts[2]["nodes"]}

    # Healed: the agent comes back, stops whatever of the stale attempt still runs, and only then
    # are its GPUs free again.
    cluster.wait_for(f"{victim} back and its GPU free",
                     lambda: cluster.node(victim)["state"] == "ready" and _held_by(cluster, victim) == {None},
                     timeout=90)
    stale = [p for p in cluster.part_processes(victim) if p.is_running()]
    assert stale == [], [p.as_dict(["pid", "status", "cmdline"]) for p in stale]


def test_postgres_restarted_mid_run_and_mid_commit(make_cluster, reference_result, embedded_pg):
    if not isinstance(embedded_pg, EmbeddedPostgres):
        pytest.skip("restarts the embedded PostgreSQL server; TRAINYARD_TEST_DATABASE_URL names one it cannot restart")
    cluster = make_cluster(nodes=2, settings={"TRAINYARD_FAILPOINTS": "checkpoint.before_commit=sleep(4)"})
    args = ["--steps", "160", "--step-delay-s", "0.1"]  # 80, 120 or 160: see reference_result
    job = cluster.submit(job_body(name="pg-restart", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20, "keep_last": 100}, max_failures=0))
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) >= 10, timeout=120)

    embedded_pg.restart(down_s=3.0)  # 1. under a running job, between commits

    # 2. In the middle of a commit: the manifest is written, the conditional UPDATE is not.
    hits = cluster.log_text("control-plane").count("failpoint hit")
    cluster.wait_for("a commit paused at the failpoint",
                     lambda: cluster.log_text("control-plane").count("failpoint hit") > hits, timeout=120, every=0.1)
    embedded_pg.restart(down_s=2.0)

    done = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert len(attempts) == 1, [a["end_reason"] for a in attempts]  # no node was declared lost
    commits = Counter(e["data"]["step"] for e in cluster.events(job["id"], "checkpoint.committed"))
    assert commits == Counter({step: 1 for step in range(20, 161, 20)}), commits
    assert [c["step"] for c in cluster.checkpoints(job["id"], "committed")] == list(range(160, 19, -20))


def test_node_reboot_work_dir_kept_processes_gone(make_cluster, reference_result):
    """Every process of a node dies at once (a reboot: the disk and the agent's work dir stay), then
    its agent starts again. The new agent finds the old attempt's state but none of its processes:
    it signals nobody, never relaunches it, reports it ended, and the job recovers exactly."""
    cluster = make_cluster(nodes=2)
    args = ["--steps", "120", "--step-delay-s", "0.05"]
    job = cluster.submit(job_body(name="reboot", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20}, max_failures=2))
    cluster.wait_for("a committed checkpoint", lambda: cluster.checkpoints(job["id"], "committed"), timeout=120)
    first = cluster.attempts(job["id"])[0]
    victim = next(n["node_name"] for n in first["nodes"] if n["node_rank"] == 1)
    killed = cluster.signal_node(victim, signal.SIGKILL)
    assert len(killed) >= 3  # the agent, torchrun, at least one worker
    cluster.dev.agent(victim).wait(10)
    work_dir = cluster.dev.config.data_dir / "nodes" / victim
    assert (work_dir / "attempts" / first["id"] / "state.json").exists()  # the disk survived

    cluster.dev.start_agent(victim)
    done = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "succeeded"], [a["end_reason"] for a in attempts]
    assert attempts[1]["restored_from_step"] >= 20
    log = cluster.log_text(victim)
    assert log.count("attempt_launched") <= 1 + sum(victim == n["node_name"] for n in attempts[1]["nodes"]), log
    cluster.wait_for("every GPU free", lambda: all(_held_by(cluster, n) == {None} for n in ("node-1", "node-2")),
                     timeout=60)


def test_control_plane_down_30s_across_the_jobs_end(make_cluster, reference_result):
    """The job ends while no control plane runs, and stays unreported for longer than any liveness
    timeout: when a control plane is back, the attempt is decided by its final status (succeeded),
    not by the silence (vanished)."""
    cluster = make_cluster(nodes=2)
    args = ["--steps", "80", "--step-delay-s", "0.1"]
    job = cluster.submit(job_body(name="cp-down-at-end", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20}, max_failures=0))
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) >= 70, timeout=120,
                     every=0.1)
    cluster.dev.restart_control_plane(kill=True, down_s=30.0)

    done = cluster.wait_state(job["id"], ENDED, timeout=120)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    [attempt] = cluster.attempts(job["id"])
    assert attempt["outcome"] == "succeeded", attempt["end_reason"]
