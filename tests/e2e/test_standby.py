"""Warm standbys end to end (issues 14 and 30), on the default path: agents that keep the default
number of standbys (``auto``: one per GPU and one for torchrun), every attempt's torchrun and ranks
started in them, and the faults of that path. The protocol piece by piece:
tests/node_agent/test_standby.py."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.factories import job_body

pytestmark = [pytest.mark.e2e, pytest.mark.standbys]
ENDED = {"succeeded", "failed", "cancelled"}
NODES = ("node-1", "node-2")


def _standby_dir(cluster, node: str) -> Path:
    said = re.search(r"standbys\s+count=(\d+) directory=(\S+)", cluster.log_text(node))
    assert said is not None, f"{node}'s agent keeps no standbys"
    assert said[1] == "2"  # auto: its GPU's and torchrun's
    return Path(said[2])


def test_recoveries_start_in_standbys_and_survive_two_failures_in_a_row_one_during_a_save(
        make_cluster, reference_result, tmp_path):
    """Rank 1 crashes (exit 3) once the agents' standbys are warm again after the first attempt took
    them; the next attempt's torchruns and ranks start in the standbys started in their place, and
    that attempt's rank 0 is killed while its checkpoint is half reported (a failure during a save,
    right after a recovery). Each attempt starts warm: what one took, the agent forked again from its
    zygote at once, without importing. The crashed rank's exact exit code comes through its standby,
    the partial checkpoint never commits, and the job ends with the weights of a run that never failed."""
    cluster = make_cluster(nodes=2)
    dirs = [_standby_dir(cluster, n) for n in NODES]
    deadline = time.monotonic() + 60
    while any(len(list(d.glob("*.sock"))) < 2 for d in dirs):  # as on nodes that have been up a while
        assert time.monotonic() < deadline, "the agents' standbys never listened"
        time.sleep(0.2)
    args = ["--steps", "80", "--step-delay-s", "0.05", "--ckpt-upload-delay-s", "2", "--ckpt-slow-rank", "1",
            "--crash-at-step", "25", "--crash-rank", "1", "--crash-once"]
    # Attempt 1 waits after its step 5 until the standbys that replace those it took listen.
    hold = ["--hold-at-step", "5", *(a for d in dirs for a in ("--standbys", f"{d}:2"))]
    job = cluster.submit(job_body(name="fast-path", entrypoint="tests/e2e/standby_job.py", args=[*hold, *args],
                                  num_nodes=2, gpus_per_node=1, checkpoint={"interval_steps": 20}, max_failures=3))

    def half_reported() -> int | None:
        attempts = cluster.attempts(job["id"])
        if len(attempts) < 2:
            return None
        return next((c["step"] for c in cluster.checkpoints(job["id"])
                     if c["attempt_number"] == 2 and c["state"] == "pending" and c["shards"] == 1), None)

    step = cluster.wait_for("a checkpoint of attempt 2 half reported", half_reported, timeout=180, every=0.1)
    # Rank 0 this time, on the other node: a node blamed for two failures of a job is avoided, and
    # this 2-node cluster has no other.
    os.kill(cluster.worker_pids(job["id"])[0][1], signal.SIGKILL)

    done = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.attempts(job["id"])
    assert [a["outcome"] for a in attempts] == ["failed", "failed", "succeeded"]
    failed = [w for n in attempts[0]["nodes"] for w in n["workers"] if w["rank"] == 1]
    assert [w["exit_code"] for w in failed] == [3]  # exact, through the standby and the shim
    assert (attempts[2]["restored_from_step"] or 0) < step  # never the partial checkpoint
    partial = [c for c in cluster.checkpoints(job["id"]) if c["attempt_number"] == 2 and c["step"] == step]
    assert [c["state"] for c in partial] == ["aborted"]
    # Both ranks of every attempt ran in standbys, with torch imported before their first line.
    logs = cluster.http.get(f"/v1/jobs/{job['id']}/logs").text
    seen = {(int(m[1]), int(m[2])): (m[3], m[4]) for m in re.finditer(
        r"standby_check rank=(\d) attempt=(\d) in_standby=(\w+) torch_loaded=(\w+)", logs)}
    assert seen == {(r, a): ("True", "True") for r in (0, 1) for a in (1, 2, 3)}, logs[-3000:]
    # So did their torchruns (node_agent/ranks/torchrun_entry.py, warm start).
    for attempt in attempts:
        for node in NODES:
            text = (tmp_path / "cluster" / "nodes" / node / "attempts" / attempt["id"]
                    / "torchrun.stderr.log").read_text()
            assert "torchrun runs warm as pid" in text and "starts cold" not in text, (node, attempt["number"], text)
