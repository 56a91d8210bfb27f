"""Warm standbys end to end (issue 14): on a 1-node cluster whose agent keeps 2 standbys, both
ranks of a job's first attempt run in standbys, a rank crashes (exit 3), and the recovery attempt's
ranks run in fresh standbys the agent started in their place; the job ends with exactly the
weights of a run nobody disturbed. The protocol piece by piece: tests/node_agent/test_standby.py."""

from __future__ import annotations

import re

import pytest

from tests.factories import job_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


@pytest.mark.parametrize("cluster", [{"nodes": 1, "gpus_per_node": 2, "standbys": 2}], indirect=True)
def test_a_jobs_ranks_run_in_standbys_through_a_recovery_with_exact_weights(cluster, reference_result):
    args = ["--steps", "40", "--crash-at-step", "25", "--crash-rank", "1", "--crash-once"]
    job = cluster.submit(job_body(name="standby", entrypoint="tests/e2e/standby_job.py", args=args, num_nodes=1,
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
