"""Agent instances are fenced like attempts (issue 9, finding 7), on real processes: a real control
plane, real agents with virtual GPUs, real torchrun.

- Two agents with one name: the newer registration wins; the older agent's reports are refused
  (409 stale-agent), it stops and exits, and the attempt it ran is not launched a second time.
- An agent restarted with a wiped work dir while its workers run: the new instance finds the
  orphaned workers by their marker in the process table and stops them, and the GPU is given to
  nobody while they live.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from node_agent.agent import EXIT_SUPERSEDED
from tests.e2e.harness import LiveCluster
from tests.factories import steps_body
from tests.helpers import ProcessReaper

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LONG = {"steps": 4000, "delay_s": 0.05}  # runs far longer than either test (and trains nothing)


def _marked(attempt_id: str) -> list[psutil.Process]:
    """Live processes of the attempt, found by the marker every process of it carries."""
    found = []
    for p in psutil.process_iter(["status"]):
        if p.pid == os.getpid() or p.info.get("status") == psutil.STATUS_ZOMBIE:
            continue
        try:
            if p.environ().get("TRAINYARD_ATTEMPT_ID") == attempt_id:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _start_agent(cluster: LiveCluster, reaper: ProcessReaper, work_dir: Path, log: Path):
    """Another agent process for node-1 (the name of the cluster's own agent)."""
    dev = cluster.dev
    return reaper.spawn(
        [sys.executable, "-m", "trainyard", "agent", "--control-plane", dev.config.replica_url(0),
         "--join-token-file", str(dev.join_token_file("node-1")), "--name", "node-1", "--address", "127.0.0.2",
         "--virtual-gpus", "1", "--work-dir", str(work_dir), "--ca-file", str(dev.tls.ca_file)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
    )


def _running_attempt(cluster: LiveCluster, job_id: str) -> str:
    def check() -> str | None:
        attempts = cluster.attempts(job_id)
        if attempts and attempts[-1]["state"] == "running" and _marked(attempts[-1]["id"]):
            return attempts[-1]["id"]
        return None
    return cluster.wait_for(f"job {job_id} running", check, timeout=120)


def _launches(attempt_id: str, *work_dirs: Path) -> int:
    """How many agents started the attempt: each creates its attempt dir before torchrun."""
    return sum((d / "attempts" / attempt_id).is_dir() for d in work_dirs)


def test_two_agents_with_one_name_the_newer_wins_and_the_older_stops(make_cluster, process_reaper, tmp_path):
    cluster = make_cluster(nodes=1, gpus_per_node=1)
    first_dir = cluster.dev.config.data_dir / "nodes" / "node-1"
    first = cluster.dev.agent("node-1")
    job = cluster.submit(steps_body(**LONG, name="fenced", num_nodes=1, gpus_per_node=1, max_failures=5))
    attempt = _running_attempt(cluster, job["id"])

    second_dir = cluster.dev.config.data_dir / "nodes" / "node-1-second"
    second_log = tmp_path / "second-agent.log"
    second = _start_agent(cluster, process_reaper, second_dir, second_log)

    # The older agent is refused and stops (exits with its own status) rather than register again.
    cluster.wait_for("the first agent to exit", lambda: first.poll() is not None, timeout=60)
    assert first.returncode == EXIT_SUPERSEDED
    first_log = cluster.log_text("node-1")
    assert "agent_superseded_stopping" in first_log and "another agent instance registered as node node-1" in first_log
    assert second.poll() is None, second_log.read_text()[-3000:]

    # Neither agent launches the attempt again; the newer one runs the job's next attempt.
    cluster.wait_for("no process of the first attempt left", lambda: not _marked(attempt), timeout=60)
    def next_attempt() -> str | None:
        attempts = cluster.attempts(job["id"])
        return attempts[-1]["id"] if attempts[-1]["id"] != attempt and attempts[-1]["state"] == "running" else None
    recovery = cluster.wait_for("the job's next attempt running", next_attempt, timeout=120)
    assert _launches(attempt, first_dir, second_dir) == 1
    assert _launches(recovery, first_dir, second_dir) == 1 and (second_dir / "attempts" / recovery).is_dir()
    assert second.poll() is None  # no flapping: the winner is still up, the loser still down
    nodes = cluster.get("/v1/nodes")
    assert [n["name"] for n in nodes] == ["node-1"] and nodes[0]["state"] == "ready"


def test_restarted_agent_with_wiped_work_dir_stops_orphans_before_the_gpu_is_free(
    make_cluster, process_reaper, tmp_path,
):
    cluster = make_cluster(nodes=1, gpus_per_node=1)
    work_dir = cluster.dev.config.data_dir / "nodes" / "node-1"
    job = cluster.submit(steps_body(**LONG, name="orphaned", num_nodes=1, gpus_per_node=1, max_failures=0))
    attempt = _running_attempt(cluster, job["id"])
    orphans = _marked(attempt)
    assert len(orphans) >= 2  # torchrun, the rank shim (and its worker)

    # The agent dies alone (its workers run in sessions of their own), and its work dir is lost.
    cluster.dev.agent("node-1").send_signal(signal.SIGKILL)
    cluster.dev.agent("node-1").wait(10)
    shutil.rmtree(work_dir)
    waiting = cluster.submit(steps_body(5, name="waiting", num_nodes=1, gpus_per_node=1))

    log = tmp_path / "restarted-agent.log"
    _start_agent(cluster, process_reaper, work_dir, log)

    deadline = time.monotonic() + 60
    while _marked(attempt):
        gpu = cluster.get("/v1/nodes")[0]["gpus"][0]
        # While any orphan lives, its GPU stays leased to its attempt: nobody else gets it.
        assert gpu["attempt_id"] == attempt, f"GPU given away while orphans live: {gpu}"
        assert cluster.job(waiting["id"])["state"] != "running"
        assert time.monotonic() < deadline, f"orphans of {attempt} still alive; agent log:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    cluster.wait_for("the orphans to be gone", lambda: all(_gone(p) for p in orphans), timeout=10)
    assert "orphaned_workers_stopping" in log.read_text()
    assert not (work_dir / "attempts" / attempt).exists()  # the new instance never started it again

    # Once the new instance reports them gone, the GPU is released and the waiting job runs.
    done = cluster.wait_state(waiting["id"], {"succeeded", "failed"}, timeout=120)
    assert done["state"] == "succeeded", done.get("end_reason")
    assert not _marked(attempt)
