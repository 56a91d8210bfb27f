"""Jobs are isolated from each other and from the node (issue 11, findings 1, 6, 7, 11), on a real
2-node dev cluster (``trainyard dev up``, run as root: its agents run every attempt as a uid of its
own, in a cgroup of its own): a hostile job (a `.py` entrypoint, tests/e2e/hostile_job.py) attacks
the node and a victim job that trains beside it. Every attack fails and says so in the hostile
job's result, its escaped process does not outlive it, and the victim ends with the weights of a
run nobody disturbed."""

from __future__ import annotations

import contextlib
import os
import signal

import psutil
import pytest

from tests.factories import job_body
from tests.helpers import need
from trainyard.dev import NOT_ISOLATED

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}
ATTACKS = {
    "read /proc/1/environ",
    "read the agent's environment",
    "find the join token on the agent's command line",
    "read the agent's join token file",
    "read the agent's node credential",
    "find storage credentials in its own environment",
    "read the other attempt's environment (its fencing token)",
    "list the agent's attempt directories",
    "read the other attempt's state.json",
    "write the other attempt's rank status",
    "add a rank status file to the other attempt",
    "read the other attempt's logs",
    "overwrite the rank shim every later job runs",
    "plant a module where later jobs import from",
    "signal the other attempt's torchrun",
    "connect to the other attempt's local API",
    "post a NaN progress report",
    "post an infinite progress report (1e999)",
    # storage grants (issue 23, finding 7)
    "ask a storage grant for a far-future step",
    "ask a storage grant for a 300 GiB shard",
    "ask a storage grant for the other job's shard",
    "write more bytes than its storage grant allows",
}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="workers run as uids of their own only under a root agent")
def test_a_hostile_job_cannot_touch_the_node_or_a_job_beside_it(cluster, reference_result):
    need(NOT_ISOLATED not in cluster.log.read_text(), "dev up could not use its uid pool here (its log says why)")
    args = ["--steps", "120", "--step-delay-s", "0.05"]
    victim = cluster.submit(job_body(name="victim", args=args, num_nodes=2, gpus_per_node=1, checkpoint={},
                                     max_failures=0))
    cluster.wait_for("the victim training", lambda: (cluster.job(victim["id"])["progress"]["step"] or 0) > 0,
                     timeout=120, every=0.2)
    hostile = cluster.submit(job_body(name="hostile", entrypoint="tests/e2e/hostile_job.py", args=[victim["id"]],
                                      num_nodes=1, gpus_per_node=1, checkpoint={}, max_failures=0))
    escapee = None
    try:
        done = cluster.wait_state(hostile["id"], ENDED, timeout=120)
        assert done["state"] == "succeeded", done["end_reason"]
        result = done["result"]
        escapee = result["escapee"]
        got_through = [a for a in result["attacks"] if not a["blocked"]]
        assert got_through == [], got_through
        assert {a["name"] for a in result["attacks"]} == ATTACKS  # every attack was tried
        assert result["uid"] != 0  # the job's code never ran as the agent's user
        # The process that left its session and scrubbed its environment went with its attempt.
        cluster.wait_for("the escaped process to be stopped", lambda: not _alive(escapee), timeout=30)

        progress_then = cluster.job(victim["id"])["progress"]["step"] or 0
        finished = cluster.wait_state(victim["id"], ENDED, timeout=180)
        assert finished["state"] == "succeeded", finished["end_reason"]
        assert finished["progress"]["step"] == 120 > progress_then  # its reports never stopped
        assert finished["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
        assert len(cluster.get(f"/v1/jobs/{victim['id']}/attempts")["items"]) == 1  # never disturbed into a recovery
    finally:
        if escapee is not None and _alive(escapee):
            with contextlib.suppress(psutil.Error):
                psutil.Process(escapee).send_signal(signal.SIGKILL)
