"""Issue 27 on a real control plane (uvicorn in this process, real Postgres, its real thread pool):
heartbeats are answered promptly while a flood of slow checkpoint bookkeeping is under way, the
excess bookkeeping is answered 503 with Retry-After (never 500), and a node whose heartbeat is only
queued is not declared lost."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from control_plane import failpoints
from control_plane.app import create_app
from control_plane.models import Node
from control_plane.settings import Settings
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for

FLOOD = 200
EVENT_S = 1.0
"""How long the failpoint holds each bookkeeping request (in its thread, with its connection)."""


@pytest.fixture
def held_failpoints() -> Iterator[None]:
    try:
        yield
    finally:
        failpoints.configure("")


def _running_attempt(http: httpx.Client, app: Any) -> tuple[FakeAgentSession, dict[str, Any]]:
    a, b = FakeAgentSession(http, "lane-1"), FakeAgentSession(http, "lane-2")  # type: ignore[arg-type]
    assert http.post("/v1/jobs", json=job_body(), headers=ADMIN).status_code == 201
    assert app.state.loops.schedule_once() == 1
    specs = [agent.heartbeat()["assignments"][0] for agent in (a, b)]
    for agent, spec in zip((a, b), specs, strict=True):
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    return a, specs[0]


def test_heartbeats_are_answered_while_bookkeeping_floods_and_the_excess_is_a_503(
        settings: Settings, held_failpoints: None) -> None:
    app = create_app(settings.model_copy(update={
        "api_threads": 40, "bookkeeping_gate": True, "bookkeeping_concurrency": 2, "bookkeeping_queue_max": 20,
        "bookkeeping_wait_s": 3.0}))
    with serve(app) as server, httpx.Client(base_url=server, timeout=30) as http:
        agent, spec = _running_attempt(http, app)
        failpoints.configure(f"agent.events=sleep({EVENT_S})")
        body = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                "events": [{"rank": 0, "kind": "checkpoint.restored", "message": "restored", "data": {"step": 1}}]}
        start = threading.Barrier(FLOOD + 1)

        def report(_: int) -> httpx.Response:
            with httpx.Client(base_url=server, timeout=httpx.Timeout(60, connect=60, pool=60)) as c:
                start.wait(60)
                return c.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json=body)

        latencies: list[float] = []
        with ThreadPoolExecutor(FLOOD) as pool:
            answers = pool.map(report, range(FLOOD), timeout=120)
            start.wait(60)
            time.sleep(0.3)  # the flood has arrived: two reports sleep in their threads, the rest queue
            while len(latencies) < 10:
                began = time.monotonic()
                agent.heartbeat([spec["attempt_id"]])
                latencies.append(time.monotonic() - began)
                time.sleep(0.2)
            metrics = http.get("/metrics").text
            responses = list(answers)

    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes  # never a 500, never a timeout
    busy = [r for r in responses if r.status_code == 503]
    assert len(busy) >= FLOOD - 20 - 2 * 4, codes  # past the queue (20), and after waiting 3 s, refused
    assert codes.count(200) >= 2
    for r in busy:
        assert r.headers["retry-after"] == "1"
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["status"] == 503
    # Ungated, the flood would hold all 40 threads for 5 s (200 x 1 s): a heartbeat would wait
    # seconds for a thread. Here it competes with at most 2 bookkeeping requests.
    assert max(latencies) < EVENT_S, latencies
    assert "trainyard_lane_refused_total" in metrics and 'trainyard_lane_waits_total{lane="bookkeeping"}' in metrics


def test_a_node_whose_heartbeat_is_queued_is_not_declared_lost(settings: Settings, held_failpoints: None) -> None:
    # Lost after 2 s of silence (tests' settings); the heartbeat below is held 3 s before it is recorded.
    app = create_app(settings)
    with serve(app) as server, httpx.Client(base_url=server, timeout=30) as http:
        agent = FakeAgentSession(http, "queued-1")  # type: ignore[arg-type]
        agent.heartbeat()
        failpoints.configure("agent.heartbeat=sleep(3)")
        held = threading.Thread(target=agent.heartbeat)
        sent = time.monotonic()
        held.start()
        time.sleep(2.5)  # the last recorded heartbeat is 2.5 s old, past the lost timeout
        assert app.state.lanes.oldest_liveness_s() > 2.0
        assert app.state.loops.monitor_once() == 0  # its heartbeat is only queued here
        held.join(10)
        failpoints.configure("")
        with app.state.session_factory() as s:
            node = s.scalars(select(Node).where(Node.name == "queued-1")).one()
            assert node.state == "ready"
            assert node.heartbeat_lag_s is not None and node.heartbeat_lag_s >= 2.5
        # Recorded as of its arrival; the lag it waited holds back every replica's monitor a while.
        time.sleep(max(0.0, sent + 2.3 - time.monotonic()))
        assert app.state.loops.monitor_once() == 0
        # A node that then stays silent is still declared lost, within twice the timeout.
        deadline = time.monotonic() + 10
        while app.state.loops.monitor_once() == 0:
            assert time.monotonic() < deadline, "a silent node was never declared lost"
            time.sleep(0.2)
        assert time.monotonic() - sent >= 2 * settings.node_lost_timeout_s - 0.5
