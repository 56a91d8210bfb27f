"""Helpers of the control-plane API tests (fixtures are in conftest.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from control_plane import clock
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


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run the app in a real server (uvicorn, in a thread of this process); yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                                        timeout_keep_alive=30, backlog=2048))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(30)
        clock.reset()
