"""Helpers of the control-plane API tests (fixtures are in conftest.py)."""

from __future__ import annotations

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


def submit(client, **body) -> dict:
    r = client.post("/v1/jobs", json=job_body(**body), headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


def get_job(client, job_id: str) -> dict:
    return client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def nodes_of(job: dict) -> set[str]:
    return {a["node_name"] for a in job["allocation"]}


def finish(agents: list[FakeAgentSession], job_id: str) -> None:
    """Every node of the job's attempt reports success and then that its processes are gone."""
    for agent in agents:
        for spec in agent.heartbeat()["assignments"]:
            if spec["job_id"] == job_id:
                agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0))
    for agent in agents:
        agent.heartbeat([])
