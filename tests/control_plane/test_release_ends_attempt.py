"""Issue 31: an attempt ends in the transaction that gives back its last GPU lease, never after.

A watcher runs after every commit of the control plane's sessions (SQLAlchemy's ``after_commit``,
an ordering hook: it sees exactly what each transaction left behind, in the order they
committed) and reads, on a connection of its own, every attempt that is not ``ended`` yet holds
no part and no lease. Before the fix the releasing transaction committed first and the attempt
ended (or, for a final report, was decided and ended) in a second one: the watcher saw that state
after every last release, deterministically, whatever the timing (tests/e2e/test_faults.py's
frozen-node test saw it only when its poll fell between the two commits)."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from control_plane.models import Node
from control_plane.services.cluster import nodes
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from tests.helpers import in_parallel
from trainyard.protocol.agent import HeartbeatRequest

HOLDING_NOTHING_NOT_ENDED = text("""
    SELECT a.id::text, a.state FROM attempts a
    WHERE a.state <> 'ended'
      AND NOT EXISTS (SELECT 1 FROM attempt_parts p WHERE p.attempt_id = a.id AND p.released_at IS NULL)
      AND NOT EXISTS (SELECT 1 FROM gpu_leases l WHERE l.attempt_id = a.id AND l.released_at IS NULL)
""")


@pytest.fixture
def broken(app, settings) -> Iterator[list[tuple[str, str]]]:
    """Every (attempt, state) some commit left not ended and holding nothing."""
    seen: list[tuple[str, str]] = []
    commits = [0]
    engine = create_engine(settings.database_url, poolclass=NullPool)

    def after_commit(session: Session) -> None:
        commits[0] += 1
        with engine.connect() as conn:
            seen.extend((str(r[0]), str(r[1])) for r in conn.execute(HOLDING_NOTHING_NOT_ENDED))

    factory = app.state.session_factory
    event.listen(factory, "after_commit", after_commit)
    try:
        yield seen
    finally:
        event.remove(factory, "after_commit", after_commit)
        engine.dispose()
    assert commits[0] > 0  # the watcher did watch the control plane's transactions


def _start(client, schedule, n: int, **overrides: Any) -> tuple[list[FakeAgentSession], dict[str, dict], dict]:
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in range(1, n + 1)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=n, gpus_per_node=1, **overrides), headers=ADMIN).json()
    assert schedule() == 1
    specs = {a.name: s for a in agents for s in a.heartbeat()["assignments"]}
    assert len(specs) == n
    for agent in agents:
        r = agent.status(specs[agent.name], "running", workers=workers_for(specs[agent.name], "running"))
        assert r.status_code == 200, r.text
    return agents, specs, job


def _attempts(client, job_id: str) -> list[dict[str, Any]]:
    return client.get(f"/v1/jobs/{job_id}/attempts", headers=ADMIN).json()["items"]


def test_the_heartbeat_that_releases_the_last_part_ends_the_attempt(client, schedule, broken):
    """The frozen-node case of tests/e2e/test_faults.py: a decided attempt whose nodes confirm
    their processes gone by heartbeat, one after the other."""
    agents, specs, job = _start(client, schedule, 2, max_failures=0)
    r = agents[1].status(specs["node-2"], "exited", exit_code=1, workers=workers_for(specs["node-2"], "exited", 1))
    assert r.status_code == 200 and r.json()["attempt_state"] == "stopping", r.text
    agents[1].heartbeat(alive=[])
    assert _attempts(client, job["id"])[0]["state"] == "stopping"  # node-1 still holds its part
    agents[0].heartbeat(alive=[])
    [attempt] = _attempts(client, job["id"])
    assert attempt["state"] == "ended" and all(n["released_at"] for n in attempt["nodes"])
    assert broken == []


def test_the_final_report_that_releases_the_last_part_ends_the_attempt(client, schedule, broken):
    """Final reports that say no process is left release their parts; the last of them ends the
    attempt, also when that report is the one that decides it (every node exited 0)."""
    agents, specs, job = _start(client, schedule, 2)
    for agent in agents:
        spec = specs[agent.name]
        r = agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0),
                         processes_alive=False, result={"loss": 0.5} if spec["node_rank"] == 0 else None)
        assert r.status_code == 200 and r.json()["released"] is True, r.text
    assert r.json()["attempt_state"] == "ended"
    [attempt] = _attempts(client, job["id"])
    assert attempt["outcome"] == "succeeded" and attempt["state"] == "ended"
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "succeeded"
    assert broken == []


def test_a_cancelled_job_is_cancelled_once_its_last_part_is_released(client, schedule, broken):
    """A release takes no job lock: the cancelling job is finished right after its commit."""
    agents, specs, job = _start(client, schedule, 2)
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "cancelling", r.text
    for agent in agents:
        agent.heartbeat(alive=[])
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "cancelled"
    assert _attempts(client, job["id"])[0]["state"] == "ended"
    assert broken == []


def test_two_last_releases_at_once_end_the_attempt_in_one_of_their_transactions(app, client, schedule, broken):
    """Two heartbeats release the gang's two parts in transactions open at the same time: the
    attempt lock orders them, so the later one sees the earlier one's release and ends the attempt
    in its own transaction; nothing after their commits (finish_released) is needed."""
    agents, specs, job = _start(client, schedule, 2, max_failures=0)
    r = agents[1].status(specs["node-2"], "exited", exit_code=1, workers=workers_for(specs["node-2"], "exited", 1))
    assert r.status_code == 200, r.text
    both_inside = threading.Barrier(2)

    def release(agent: FakeAgentSession) -> None:
        session = app.state.session_factory()
        try:
            node = session.get(Node, uuid.UUID(agent.node_id))
            nodes.heartbeat(session, node, HeartbeatRequest(agent_instance="race", seq=1000, attempts=[]))
            with contextlib.suppress(threading.BrokenBarrierError):
                both_inside.wait(timeout=1.0)  # both in their transaction, unless one waits for the other
            session.commit()
        finally:
            session.close()

    in_parallel(release, [(a,) for a in agents], timeout=30)
    [attempt] = _attempts(client, job["id"])
    assert all(n["released_at"] for n in attempt["nodes"]) and attempt["state"] == "ended"
    assert broken == []
