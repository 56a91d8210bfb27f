"""A node's own faults, on real processes: its agent restarted in the middle of an attempt (the
workers keep running and the attempt ends cleanly under the new agent), and its disk full (the
attempt fails at once with the reason, the agent survives, and the node runs the next job once
there is room again)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.harness import LiveCluster
from tests.factories import job_body, steps_body
from tests.helpers import need

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


def test_agent_restarted_mid_attempt_then_a_clean_exit_succeeds_exactly(make_cluster, reference_result):
    cluster = make_cluster(nodes=2)
    args = ["--steps", "120", "--step-delay-s", "0.1"]
    job = cluster.submit(job_body(name="agent-restart", args=args, num_nodes=2, gpus_per_node=1,
                                  checkpoint={"interval_steps": 20}, max_failures=0))
    cluster.wait_for("progress", lambda: (cluster.job(job["id"])["progress"]["step"] or 0) >= 15, timeout=120)
    pids = cluster.worker_pids(job["id"])

    # The agent alone dies (its torchrun runs in a session of its own and keeps training).
    agent = cluster.dev.agent("node-2")
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    cluster.dev.start_agent("node-2")

    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    [attempt] = cluster.attempts(job["id"])  # never restarted: the new agent adopted the running workers
    assert attempt["outcome"] == "succeeded", attempt["end_reason"]
    assert {w["rank"]: w["pid"] for n in attempt["nodes"] for w in n["workers"]} == {
        rank: pid for rank, (_node, pid) in pids.items()}
    assert all(w["exit_code"] == 0 for n in attempt["nodes"] for w in n["workers"]), attempt["nodes"]
    assert "attempt_adopted" in cluster.log_text("node-2")


def _fill(directory: Path) -> None:
    """Write to ``directory`` until its file system refuses (ENOSPC)."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)


def test_full_disk_on_a_node_fails_the_attempt_with_the_reason_and_the_node_recovers(
    make_cluster, tmp_path: Path, request: pytest.FixtureRequest,
):
    work_dir = tmp_path / "cluster" / "nodes" / "node-1"  # where the dev cluster puts node-1's work dir
    work_dir.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(work_dir)],
                             capture_output=True, text=True)
    need(mounted.returncode == 0,
         f"needs a small file system of its own (mount tmpfs as root): {mounted.stderr.strip()}")
    request.addfinalizer(lambda: subprocess.run(["umount", "-l", str(work_dir)], check=False))

    cluster: LiveCluster = make_cluster(nodes=1)
    _fill(work_dir)
    job = cluster.submit(job_body(name="full-disk", args=["--steps", "5"], num_nodes=1, gpus_per_node=1,
                                  max_failures=0))
    done = cluster.wait_state(job["id"], ENDED, timeout=120)
    assert done["state"] == "failed"
    assert "no space left on device" in done["end_reason"], done["end_reason"]
    assert cluster.dev.agent("node-1").poll() is None  # the agent lives on
    cluster.wait_for("the GPU released", lambda: cluster.node("node-1")["gpus"][0]["attempt_id"] is None,
                     timeout=60)

    (work_dir / "filler").unlink()  # room again: the same node runs the next job
    again = cluster.submit(steps_body(5, name="room-again", num_nodes=1, gpus_per_node=1))
    assert cluster.wait_state(again["id"], ENDED, timeout=120)["state"] == "succeeded"
