"""Warm standbys end to end (issues 14 and 30): on a 1-node cluster whose agent keeps the default
number of standbys (``auto``: one per GPU and one for torchrun), each attempt's torchrun and both
its ranks run in standbys, a rank crashes (exit 3), and the recovery attempt's torchrun and ranks
run in fresh standbys the agent started in their place; the job ends with exactly the weights of a
run nobody disturbed. The protocol piece by piece: tests/node_agent/test_standby.py."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.factories import job_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus_per_node": 2,
                                      "env": {"TRAINYARD_AGENT_STANDBYS": "auto"}}], indirect=True)
def test_a_jobs_ranks_run_in_standbys_through_a_recovery_with_exact_weights(cluster, reference_result, tmp_path):
    # The agent's standbys import torch and its compiler stack (a few seconds here): the first
    # attempt waits for them to listen, as a node that has been up a while would have them.
    said = re.search(r"standbys\s+count=(\d+) directory=(\S+)",
                     (tmp_path / "cluster" / "logs" / "node-1.log").read_text())
    assert said is not None and said[1] == "3"  # auto: 2 GPUs and torchrun
    deadline = time.monotonic() + 60
    while len(list(Path(said[2]).glob("*.sock"))) < 3:
        assert time.monotonic() < deadline, "the agent's standbys never listened"
        time.sleep(0.2)
    args = ["--steps", "40", "--crash-at-step", "25", "--crash-rank", "1", "--crash-once"]
    job = cluster.submit(job_body(name="standby", entrypoint="tests/e2e/standby_job.py",
                                  args=["--standbys", f"{said[2]}:3", *args], num_nodes=1,
                                  gpus_per_node=2, checkpoint={"interval_steps": 10}, max_failures=1))
    done = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert done["state"] == "succeeded", done["end_reason"]
    assert done["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert [a["outcome"] for a in attempts] == ["failed", "succeeded"]
    # The crashed rank's exact exit code came through the standby to the shim and the agent.
    failed = [w for n in attempts[0]["nodes"] for w in n["workers"] if w["rank"] == 1]
    assert [w["exit_code"] for w in failed] == [3]
    logs = cluster.http.get(f"/v1/jobs/{job['id']}/logs").text
    seen = {(int(m[1]), int(m[2])): (m[3], m[4]) for m in re.finditer(
        r"standby_check rank=(\d) attempt=(\d) in_standby=(\w+) torch_loaded=(\w+)", logs)}
    assert seen == {(r, a): ("True", "True") for r in (0, 1) for a in (1, 2)}, logs[-3000:]
    # Each attempt's torchrun ran in a standby too (node_agent/ranks/torchrun_entry.py, warm start).
    said = {path.parent.name: path.read_text() for path in
            (tmp_path / "cluster" / "nodes" / "node-1" / "attempts").glob("*/torchrun.stderr.log")}
    assert sorted(said) == sorted(a["id"] for a in attempts)
    assert all("torchrun runs warm as pid" in text and "starts cold" not in text for text in said.values()), said
