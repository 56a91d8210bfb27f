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
import secrets
import shutil
import signal
import sys
import tarfile
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.factories import job_body
from tests.helpers import make_wheel_with, need
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
    "flood its agent's memory tier with 32 PUTs announcing 4 GiB each",
    "list the node's venv cache (other tenants' requirements) or plant one",
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


# Small part limits for this cluster's agents (issue 23, finding 6), so that a memory hog and a fork bomb
# beside the victim meet them quickly on a shared test machine; the victim fits well inside them.
PART_LIMITS = {"TRAINYARD_AGENT_PART_MEMORY_LIMIT": "2G", "TRAINYARD_AGENT_PART_PIDS_MAX": "512",
               "TRAINYARD_AGENT_PART_SHM_SIZE": "256M"}
HOGS = {"memory": "out of memory: cgroup limit 2 GiB", "forkbomb": "process limit: pids.max 512 reached"}


def _submit_hogs(cluster: Any) -> dict[str, dict[str, Any]]:
    """A memory hog and a fork bomb, each a job of its own beside the victim."""
    return {what: cluster.submit(job_body(name=f"hog-{what}", entrypoint="tests/e2e/hog_job.py", args=[what],
                                          num_nodes=1, gpus_per_node=1, checkpoint={}, max_failures=0))
            for what in HOGS}


def _hogs_stopped_at_their_limits(cluster: Any, hogs: dict[str, dict[str, Any]]) -> None:
    """Each hog's job failed with its part's limit as the reason, and no node was lost over it."""
    for what, job in hogs.items():
        ended = cluster.wait_state(job["id"], ENDED, timeout=240)
        assert ended["state"] == "failed" and HOGS[what] in (ended["end_reason"] or ""), (what, ended)
    assert {node["state"] for node in cluster.get("/v1/nodes")} == {"ready"}


@pytest.mark.skipif(os.geteuid() != 0, reason="workers run as uids of their own only under a root agent")
@pytest.mark.parametrize("cluster", [{"env": PART_LIMITS}], indirect=True)
@pytest.mark.timeout(600)  # a victim, a hostile job, a bomb, two hogs and the planted interpreters, one after another
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
    # The hostile job first: it needs the victim's torchrun on its node, so it takes one of the two free
    # slots now. The hogs and the bomb queue for the other (and for the hostile job's, once it ends);
    # submitted before it, they held it back until the victim had finished on a loaded machine (CI,
    # stop 33: "the victim job's torchrun never showed on this node").
    hostile = cluster.submit(job_body(name="hostile", entrypoint="tests/e2e/hostile_job.py",
                                      args=[victim["id"], code_sha],
                                      num_nodes=1, gpus_per_node=1, checkpoint={}, max_failures=0))
    hogs = _submit_hogs(cluster)
    bomb = _submit_bomb(cluster)
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

        finished = cluster.wait_state(victim["id"], ENDED, timeout=180)
        assert finished["state"] == "succeeded", finished["end_reason"]
        assert finished["progress"]["step"] == 120
        # Its reports never stopped: it reported progress while the hostile job's workers ran (not
        # only before or after them; on a loaded machine the victim may end before the hostile job
        # does, which says nothing against it).
        (attack,) = cluster.get(f"/v1/jobs/{hostile['id']}/attempts")["items"]
        attack_began = datetime.fromisoformat(attack["started_at"])
        samples = cluster.get(f"/v1/jobs/{victim['id']}/progress", params={"limit": 500})["items"]
        reported_during = [s for s in samples if datetime.fromisoformat(s["at"]) > attack_began]
        assert reported_during, (attack_began, samples[-3:])
        assert finished["result"]["weights_sha256"] == reference_result(args)["weights_sha256"]
        assert len(cluster.get(f"/v1/jobs/{victim['id']}/attempts")["items"]) == 1  # never disturbed into a recovery
        _bomb_failed_alone(cluster, bomb)
        _hogs_stopped_at_their_limits(cluster, hogs)
        check_planted_interpreters_are_refused(cluster)  # issue 23 (on the slots the hostile job freed)
    finally:
        if escapee is not None and _alive(escapee):
            with contextlib.suppress(psutil.Error):
                psutil.Process(escapee).send_signal(signal.SIGKILL)


# --- issue 23, finding 1: a job's interpreter (self-contained; called from the test above) ---


def check_planted_interpreters_are_refused(cluster: Any) -> None:
    """A first job plants an executable script in /dev/shm; a second job naming it as its python is
    refused at submit (422, naming the field). A path that passes submit but that this node does not
    allow (its directory writable by others) fails the attempt at once with the reason, no retry; so
    does a wheel that replaces the venv's interpreter. No planted script ever runs, as anyone. Uses
    the slots the hostile job freed."""
    planted = f"/dev/shm/trainyard-planted-{secrets.token_hex(6)}"
    planter = cluster.submit(job_body(name="planter", entrypoint="tests/e2e/planter_job.py", args=[planted, "15"],
                                      num_nodes=1, gpus_per_node=1, checkpoint={}, max_failures=0))
    shared = Path(tempfile.mkdtemp(prefix="trainyard-e2e-python-", dir="/run"))
    wheels = Path(tempfile.mkdtemp(prefix="trainyard-e2e-wheels-", dir="/tmp"))
    try:
        # Its /dev/shm is its part's own now (finding 6: a tmpfs per part): the test reads from its log
        # that it planted the script, and as which uid; no other part, nor the agent, sees the file.
        def planted_line() -> str | None:
            text = cluster.http.get(f"/v1/jobs/{planter['id']}/logs").text
            return next((line for line in text.splitlines() if f"planted {planted} as uid " in line), None)

        line = cluster.wait_for("the planter's script", planted_line, timeout=120)
        assert int(line.rsplit(" ", 1)[1]) != 0  # written by the first job's own uid
        assert not os.path.exists(planted)  # the host's /dev/shm never saw it
        refused = cluster.http.post("/v1/jobs", json=job_body(name="planted", python=planted, num_nodes=1,
                                                               gpus_per_node=1, checkpoint={}))
        assert refused.status_code == 422, refused.text
        assert refused.headers["content-type"].startswith("application/problem+json")
        assert "python" in refused.text and "/dev/shm" in refused.text and "--allowed-python" in refused.text

        shared.chmod(0o777)  # anyone may replace what is in it: passes submit, not the node's rule
        python = shared / "python"
        python.write_text(f"#!/bin/sh\nid -u >> {shared}/ran\nexec {sys.executable} \"$@\"\n")
        python.chmod(0o755)
        job = cluster.submit(job_body(name="unlisted-python", python=str(python), num_nodes=1, gpus_per_node=1,
                                      checkpoint={}, max_failures=3))
        failed = cluster.wait_state(job["id"], ENDED, timeout=120)
        attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
        assert failed["state"] == "failed" and len(attempts) == 1, (failed, attempts)  # not retried
        assert attempts[0]["failure_kind"] == "start_error", attempts[0]
        assert "not allowed on this node" in failed["end_reason"] and "writable by others" in failed["end_reason"]
        assert not os.path.exists(shared / "ran")  # it never ran

        # A wheel whose scripts replace the venv's interpreter: the build (as the part's uid) is
        # refused, the job fails at once, and the planted interpreter never runs.
        wheels.chmod(0o755)
        evil = f"#!/bin/sh\nid -u >> {wheels}/ran\nexec {sys.executable} \"$@\"\n"
        make_wheel_with(wheels, "evilpkg", "1.0", {"evilpkg.py": "X = 1\n", "evilpkg-1.0.data/scripts/python": evil})
        job = cluster.submit(job_body(name="evil-wheel", requirements=f"--no-index\n--find-links {wheels}\nevilpkg\n",
                                      num_nodes=1, gpus_per_node=1, checkpoint={}, max_failures=3))
        failed = cluster.wait_state(job["id"], ENDED, timeout=180)
        assert failed["state"] == "failed" and "replaced the venv's interpreter" in failed["end_reason"], failed
        assert len(cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]) == 1
        assert not os.path.exists(wheels / "ran")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(wheels, ignore_errors=True)
    assert cluster.wait_state(planter["id"], ENDED, timeout=60)["state"] == "succeeded"


