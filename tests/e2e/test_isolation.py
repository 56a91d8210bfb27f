"""Jobs are isolated from each other and from the node (issue 11, findings 1, 6, 7, 11), on a real
2-node dev cluster (``trainyard dev up``, run as root: its agents run every attempt as a uid of its
own, in a cgroup of its own): a hostile job (a `.py` entrypoint, tests/e2e/hostile_job.py) attacks
the node and a victim job that trains beside it. Every attack fails and says so in the hostile
job's result, its escaped process does not outlive it, and the victim ends with the weights of a
run nobody disturbed."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import signal
import tarfile
from typing import Any

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
    "list the node's code cache",
    "read the other job's code archive in the node's cache",
    "read the other attempt's unpacked code",
    "post a NaN progress report",
    "post an infinite progress report (1e999)",
}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- issue 23, findings 3 and 4: shipped code ---


def _upload(cluster: Any, files: dict[str, bytes] | None = None, *, declared: int | None = None) -> str:
    """Upload a tar.gz of ``files`` (or of one header announcing ``declared`` bytes: a bomb whose
    zeros never need to follow, since the node's cap stops at the header); its sha256."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in (files or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if declared is not None:
            info = tarfile.TarInfo("zeros")
            info.size = declared
            tar.addfile(info)
    archive = gzip.compress(raw.getvalue())
    sha = hashlib.sha256(archive).hexdigest()
    r = cluster.http.put(f"/v1/code/{sha}", content=archive, headers={"Content-Type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    return sha


def _submit_bomb(cluster: Any) -> dict[str, Any]:
    """An archive bomb, submitted beside the victim."""
    sha = _upload(cluster, declared=256 << 30)
    return cluster.submit(job_body(name="bomb", entrypoint="train.py", args=[], num_nodes=1, gpus_per_node=1,
                                   checkpoint={}, max_failures=3, code={"sha256": sha}))


def _bomb_failed_alone(cluster: Any, bomb: dict[str, Any]) -> None:
    """The bomb's job failed at once with the reason, on its first attempt, and no node was ever
    declared lost (the unpacking never held a heartbeat back)."""
    failed = cluster.wait_state(bomb["id"], ENDED, timeout=120)
    assert failed["state"] == "failed" and "unpacks to more than 4.0 GiB" in failed["end_reason"], failed
    assert len(cluster.get(f"/v1/jobs/{bomb['id']}/attempts")["items"]) == 1  # not retried
    assert {node["state"] for node in cluster.get("/v1/nodes")} == {"ready"}


@pytest.mark.skipif(os.geteuid() != 0, reason="workers run as uids of their own only under a root agent")
def test_a_hostile_job_cannot_touch_the_node_or_a_job_beside_it(cluster, reference_result):
    need(NOT_ISOLATED not in cluster.log.read_text(), "dev up could not use its uid pool here (its log says why)")
    # Long enough (24 s) to still be training when the hostile job and the bomb beside it are done.
    args = ["--steps", "120", "--step-delay-s", "0.2"]
    # The victim ships code (its entrypoint is still the installed module: the same weights).
    code_sha = _upload(cluster, {"victim_code.py": b"SECRET = 'the victim tenant's code'\n"})
    victim = cluster.submit(job_body(name="victim", args=args, num_nodes=2, gpus_per_node=1, checkpoint={},
                                     max_failures=0, code={"sha256": code_sha}))
    cluster.wait_for("the victim training", lambda: (cluster.job(victim["id"])["progress"]["step"] or 0) > 0,
                     timeout=120, every=0.2)
    bomb = _submit_bomb(cluster)
    hostile = cluster.submit(job_body(name="hostile", entrypoint="tests/e2e/hostile_job.py",
                                      args=[victim["id"], code_sha],
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
        _bomb_failed_alone(cluster, bomb)
    finally:
        if escapee is not None and _alive(escapee):
            with contextlib.suppress(psutil.Error):
                psutil.Process(escapee).send_signal(signal.SIGKILL)
