"""A job that brings its own launcher, end to end (issue 26 item 7): the example's shell script
(examples/run_torchrun.sh) runs `python -m torch.distributed.run` with its own flags on every node of
a real dev cluster, on a training script of a user's (examples/train_minimal.py: worker_runtime for
checkpoints and progress). Its logs reach the API; one node's training process SIGKILLed after a
checkpoint fails the attempt, and the next resumes from the checkpoint and ends with the weights of a
run that never broke (which runs beside it on the cluster's other GPUs)."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.factories import job_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}
COMMAND = ["examples/run_torchrun.sh", "--steps", "80", "--step-time-s", "0.1"]  # relative: against the code


def _body(name: str) -> dict:
    body = job_body(name=name, command=COMMAND, num_nodes=2, gpus_per_node=1, checkpoint={"interval_steps": 20})
    del body["entrypoint"], body["args"]
    return body


def _committed(cluster, job_id: str) -> list[dict]:
    return [c for c in cluster.get(f"/v1/jobs/{job_id}/checkpoints")["items"] if c["state"] == "committed"]


def _training_processes(cluster, job_id: str) -> list[psutil.Process]:
    """Node rank 1's training processes: the children of the torchrun its command exec'd (the part's
    reported pid)."""
    attempt = cluster.get(f"/v1/jobs/{job_id}/attempts")["items"][-1]
    [part] = [n for n in attempt["nodes"] if n["node_rank"] == 1]
    pids = [w["pid"] for w in part["workers"] if w["pid"] and w["state"] == "running"]
    try:
        children = [c for pid in pids for c in psutil.Process(pid).children()]
        return [c for c in children if "train_minimal.py" in " ".join(c.cmdline())]
    except psutil.NoSuchProcess:
        return []


# No node is lost here: a machine too loaded to heartbeat for 10 s must not fail the test (node
# avoidance would blame a node twice, for the loss and for the kill, and give the job up). 30 s:
# the most the default launch timeout allows.
@pytest.mark.parametrize("cluster", [{"env": {"TRAINYARD_NODE_LOST_TIMEOUT_S": "30"}}], indirect=True)
def test_a_shell_script_that_runs_torchrun_itself_logs_and_resumes_exactly(cluster):
    clean = cluster.submit(_body("clean"))
    job = cluster.submit(_body("killed"))
    cluster.wait_for("a committed checkpoint", lambda: _committed(cluster, job["id"]), timeout=150)
    victims = cluster.wait_for("node rank 1's training process", lambda: _training_processes(cluster, job["id"]),
                               timeout=30)
    for victim in victims:
        os.kill(victim.pid, signal.SIGKILL)

    done = cluster.wait_state(clean["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    resumed = cluster.wait_state(job["id"], ENDED, timeout=240)
    assert resumed["state"] == "succeeded", resumed["end_reason"]
    assert resumed["command"] == COMMAND and resumed["progress"]["step"] == 80

    attempts = cluster.get(f"/v1/jobs/{job['id']}/attempts")["items"]
    assert len(attempts) == 2 and attempts[0]["outcome"] == "failed", [a["end_reason"] for a in attempts]
    assert "rank 1" in attempts[0]["end_reason"]  # node rank 1's part: its command's exit
    assert attempts[1]["restored_from_step"] is not None and attempts[1]["restored_from_step"] >= 20
    assert resumed["result"]["restored_from_step"] == attempts[1]["restored_from_step"]
    assert resumed["result"]["weights_sha256"] == done["result"]["weights_sha256"]
    # Each node's part is one worker (its command), at the node's first rank, exited 0 in the end.
    workers = {n["node_rank"]: [(w["rank"], w["exit_code"]) for w in n["workers"]] for n in attempts[1]["nodes"]}
    assert workers == {0: [(0, 0)], 1: [(1, 0)]}

    logs = cluster.http.get(f"/v1/jobs/{job['id']}/logs").text
    assert "rendezvous at" in logs  # the script's own line
    assert "weights_sha256" in logs  # the training script's result, through torchrun's output
