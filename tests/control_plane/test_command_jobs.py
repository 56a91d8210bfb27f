"""`command` jobs at the control plane (issue 26 item 7): what a submit may say (a command or an
entrypoint, never both; bounded; no NUL), what the agents are given (the command, in every node's
spec), and the parts' reports of a command job (one worker per node, at the node's first rank)
driving the attempt like any other."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body

COMMAND = ["bash", "examples/run_torchrun.sh", "--steps", "100"]


def _command_body(**overrides: Any) -> dict[str, Any]:
    body = job_body(name="cmd", command=COMMAND, num_nodes=2, gpus_per_node=2, **overrides)
    del body["entrypoint"], body["args"]
    return body


@pytest.mark.parametrize(("change", "says"), [
    ({"entrypoint": "train.py"}, "not both"),
    ({"args": ["--steps", "3"]}, "not both"),
    ({"restartable": True}, "cannot be `restartable`"),
    ({"command": None}, "give `entrypoint`"),
    ({"command": []}, "command"),
    ({"command": [""]}, "command"),
    ({"command": ["bash", "nul\u0000byte"]}, "command"),
    ({"command": ["x"] * 257}, "command"),
    ({"command": ["x" * 4097]}, "command"),
    ({"command": "bash run.sh"}, "command"),  # argv, not a shell line
])
def test_a_bad_command_is_a_422_problem_that_says_why(client, change, says) -> None:
    body = {**_command_body(), **change}
    r = client.post("/v1/jobs", json=body, headers=ADMIN)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert says in r.text, r.text
    assert client.get("/v1/jobs", headers=ADMIN).json()["items"] == []


def test_a_command_job_is_given_to_every_node_and_runs_fails_and_recovers_as_any_job(client, schedule) -> None:
    agents = [FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")]
    r = client.post("/v1/jobs", json=_command_body(max_failures=2), headers=ADMIN)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["command"] == COMMAND and job["entrypoint"] == "" and job["args"] == []
    assert schedule() == 1
    specs = [a.heartbeat()["assignments"][0] for a in agents]
    assert all(s["command"] == COMMAND and s["nproc_per_node"] == 2 and not s["restartable"] for s in specs)

    def part(spec: dict[str, Any], state: str, exit_code: int | None = None) -> dict[str, Any]:
        # What an agent reports of a command job's part: one worker, the node's first global rank.
        return {"rank": spec["node_rank"] * 2, "local_rank": 0, "pid": 4242, "state": state, "exit_code": exit_code}

    for agent, spec in zip(agents, specs, strict=True):
        r = agent.status(spec, "running", workers=[part(spec, "running")])
        assert r.status_code == 200, r.text
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "running"
    # Another node's block is refused as for any job (fencing.check_worker_block).
    wrong = {**part(specs[0], "running"), "rank": 1, "local_rank": 0}
    assert agents[0].status(specs[0], "running", workers=[wrong]).status_code == 403

    # Node rank 1's command exits 1: the attempt fails and the job recovers with a new attempt.
    failing = next(i for i, s in enumerate(specs) if s["node_rank"] == 1)
    r = agents[failing].status(specs[failing], "exited", exit_code=1, workers=[part(specs[failing], "exited", 1)],
                               error="the command exited with 1: ...boom")
    assert r.status_code == 200, r.text
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempts[0]["outcome"] == "failed", attempts[0]
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] in ("recovering", "starting", "queued")


def test_the_example_job_file_is_a_valid_command_job_whose_script_is_shipped_executable() -> None:
    """examples/command.yaml, as `trainyard run` reads it: a command job, its script executable (a
    relative argv[0] is exec'd in the shipped code, whose modes keep the executable bit)."""
    from pathlib import Path

    from control_plane.schemas.jobs import JobSubmit
    from trainyard.cli.jobs import load_spec

    examples = Path(__file__).resolve().parents[2] / "examples"
    body, workdir = load_spec(examples / "command.yaml")
    job = JobSubmit.model_validate(body)
    assert job.command is not None and job.entrypoint is None and workdir == examples
    script = examples / job.command[0]
    assert script.is_file() and os.access(script, os.X_OK), script
    text = script.read_text()
    assert "torch.distributed.run" in text and '--node-rank "${NODE_RANK}"' in text
