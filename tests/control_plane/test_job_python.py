"""A job's interpreter (issue 23, finding 1): a ``python`` in a place any user or job can write
(/dev/shm, /tmp, a home) is refused at submit with problem+json naming the field; one that only a
node can judge travels in the launch spec (its refusal there: tests/node_agent/test_interpreters.py)."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body


@pytest.mark.parametrize("python", ["/dev/shm/trainyard-planted", "/tmp/x/bin/python", "/home/alice/venv/bin/python",
                                    "/var/tmp/python"])
def test_an_interpreter_anyone_could_have_written_is_refused_at_submit(client, python) -> None:
    refused = client.post("/v1/jobs", json=job_body(num_nodes=1, python=python), headers=ADMIN)
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"].startswith("application/problem+json")
    problem = refused.json()
    assert problem["detail"].startswith("python: ") and "--allowed-python" in problem["detail"], problem
    climbing = client.post("/v1/jobs", json=job_body(num_nodes=1, python="/opt/envs/../../tmp/python"), headers=ADMIN)
    assert climbing.status_code == 422 and "'..'" in climbing.json()["detail"], climbing.text


def test_an_interpreter_the_nodes_judge_is_accepted_at_submit(client) -> None:
    FakeAgentSession(client, "node-1", 2)
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, python="/opt/envs/llm/bin/python"), headers=ADMIN)
    assert job.status_code == 201 and job.json()["python"] == "/opt/envs/llm/bin/python", job.text
