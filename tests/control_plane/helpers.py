"""Helpers of the control-plane API tests (fixtures are in conftest.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from control_plane import clock
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from trainyard.embedded import free_port


def submit(client, **body) -> dict:
    r = client.post("/v1/jobs", json=job_body(**body), headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


def start_running(client, schedule, agents: list[FakeAgentSession], **body) -> tuple[dict, dict[str, dict]]:
    """Submit a job (2 nodes x 1 GPU unless ``body`` says otherwise), schedule it, and report every
    part it placed running; returns the job and its specs by agent name."""
    job = client.post("/v1/jobs", json=job_body(**{"num_nodes": 2, "gpus_per_node": 1, "max_failures": 3, **body}),
                      headers=ADMIN).json()
    assert schedule() == 1
    specs = {a.name: spec for a in agents for spec in a.heartbeat()["assignments"]}
    for agent in agents:
        if agent.name in specs:
            spec = specs[agent.name]
            r = agent.status(spec, "running", workers=workers_for(spec, "running"))
            assert r.status_code == 200, r.text
    return job, specs


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


@contextmanager
def running(server: uvicorn.Server, *, must_stop: bool = False) -> Iterator[uvicorn.Server]:
    """Run ``server`` in a thread of this process; yields once it has started and stops it at exit
    (``must_stop``: fail if it has not stopped 30 s later)."""
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)
        assert not (must_stop and thread.is_alive()), "uvicorn did not stop"


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run the app in a real server (uvicorn, in a thread of this process); yields its base URL."""
    port = free_port()
    try:
        with running(uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                   lifespan="on", timeout_keep_alive=30, backlog=2048))):
            yield f"http://127.0.0.1:{port}"
    finally:
        clock.reset()
