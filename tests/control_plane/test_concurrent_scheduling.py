"""Scheduling passes run concurrently (as several replicas would) never allocate a GPU twice and
never apply the same decision twice."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from control_plane.app import create_app
from control_plane.db import make_engine, make_session_factory
from control_plane.scheduler import allocate
from control_plane.scheduler.allocate import schedule_pass
from tests.factories import ADMIN, FakeAgentSession, job_body, register_node, workers_for
from tests.helpers import wait_for


def _invariants(url: str) -> dict[str, object]:
    engine = create_engine(url)
    with engine.connect() as conn:
        def scalar(sql: str) -> object:
            return conn.execute(text(sql)).scalar()

        out = {
            "double_leased": conn.execute(text(
                "SELECT gpu_id FROM gpu_leases WHERE released_at IS NULL GROUP BY gpu_id HAVING count(*) > 1"
            )).all(),
            "partial": conn.execute(text(
                "SELECT a.id FROM attempts a LEFT JOIN gpu_leases l ON l.attempt_id = a.id "
                "GROUP BY a.id, a.num_gpus HAVING count(l.id) <> a.num_gpus"
            )).all(),
            # No job failed here, so a job with two attempts is a decision applied twice.
            "attempts_per_job": dict(conn.execute(text("SELECT job_id, count(*) FROM attempts GROUP BY job_id")).all()),
            "allocated_events": scalar("SELECT count(*) FROM events WHERE kind = 'attempt.allocated'"),
            "leased": scalar("SELECT count(*) FROM gpu_leases WHERE released_at IS NULL"),
            "node_in_two_reservations": conn.execute(text(
                "SELECT n FROM reservations, unnest(node_ids) AS n WHERE ended_at IS NULL "
                "GROUP BY n HAVING count(*) > 1"
            )).all(),
            "active_reservations_per_job": conn.execute(text(
                "SELECT job_id FROM reservations WHERE ended_at IS NULL AND kind = 'job' GROUP BY job_id "
                "HAVING count(*) > 1"
            )).all(),
        }
    engine.dispose()
    return out


def _replicas(settings, count: int, passes: int) -> tuple[list[int], list[BaseException]]:
    engines = [make_engine(settings.database_url, pool_size=2) for _ in range(count)]
    factories = [make_session_factory(e) for e in engines]
    admitted: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def replica(factory) -> None:
        barrier.wait()
        for _ in range(passes):
            s = factory()
            try:
                admitted.append(len(schedule_pass(s, settings)))
            except Exception as exc:  # the database refusing a conflicting decision
                errors.append(exc)
                s.rollback()
            finally:
                s.close()

    threads = [threading.Thread(target=replica, args=(f,)) for f in factories]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in engines:
        e.dispose()
    return admitted, errors


def test_parallel_passes_never_double_allocate(client, settings):
    for i in range(4):
        register_node(client, f"node-{i}", 2)
    for i in range(12):
        client.post("/v1/jobs", json=job_body(name=f"j{i}", num_nodes=1 + i % 2, gpus_per_node=1 + i % 2),
                    headers=ADMIN)

    admitted, errors = _replicas(settings, count=4, passes=5)

    state = _invariants(settings.database_url)
    assert errors == []
    assert state["double_leased"] == [] and state["partial"] == []
    assert state["node_in_two_reservations"] == [] and state["active_reservations_per_job"] == []
    started = client.get("/v1/jobs", params={"state": "starting"}, headers=ADMIN).json()["items"]
    assert started and sum(admitted) == len(started)  # each decision applied exactly once
    assert set(state["attempts_per_job"].values()) == {1} and state["allocated_events"] == len(started)
    assert state["leased"] == sum(j["num_nodes"] * j["gpus_per_node"] for j in started) <= 8


def test_two_passes_deciding_on_the_same_snapshot_apply_it_once(client, settings, monkeypatch):
    """Without the advisory lock, two passes read the same queue and capacity and reach the same
    decision; the admitted jobs are locked and re-checked, so only one pass applies it."""
    for i in range(3):
        register_node(client, f"node-{i}", 2)
    for i in range(5):
        client.post("/v1/jobs", json=job_body(name=f"j{i}", num_nodes=1, gpus_per_node=2), headers=ADMIN)
    decided = threading.Barrier(2)
    real_decide = allocate.decide
    decisions = []

    def decide_then_wait(*args, **kwargs):
        d = real_decide(*args, **kwargs)
        decisions.append(sorted(p.job_id for p in d.placements))
        decided.wait(30)  # both passes hold the same decision before either applies it
        return d

    monkeypatch.setattr(allocate, "_try_lock", lambda session: True)
    monkeypatch.setattr(allocate, "decide", decide_then_wait)

    admitted, errors = _replicas(settings, count=2, passes=1)

    assert len(decisions) == 2 and decisions[0] == decisions[1] and len(decisions[0]) == 3
    assert sorted(admitted) == [0, 3] and errors == []  # the second found the jobs already started
    state = _invariants(settings.database_url)
    assert state["double_leased"] == [] and state["partial"] == []
    assert set(state["attempts_per_job"].values()) == {1} and len(state["attempts_per_job"]) == 3
    assert state["allocated_events"] == 3 and state["leased"] == 6


def test_a_rendezvous_port_is_unique_per_host_not_per_cluster(fresh_database_url):
    """With one port in the range, two single-node jobs on two nodes (two rendezvous hosts) both
    start, and the database refuses the port twice on one host. (Ports were unique cluster-wide: a
    1,000-node cluster ran out of them long before its GPUs, and the default range reached into
    Linux's ephemeral ports, where an outgoing connection's local port made torchrun's store fail
    with EADDRINUSE.)"""
    from fastapi.testclient import TestClient

    from control_plane.app import create_app
    from control_plane.settings import Settings
    from tests.control_plane.conftest import ADMIN_TOKEN, JOIN_TOKEN

    assert Settings.model_fields["rdzv_port_max"].default < 32768  # below the ephemeral range
    settings = Settings(database_url=fresh_database_url, admin_token=ADMIN_TOKEN, join_token=JOIN_TOKEN,
                        run_loops=False, log_json=False, startup_grace_s=0, rdzv_port_min=30000,
                        rdzv_port_max=30000)
    app = create_app(settings)
    with TestClient(app) as client:
        register_node(client, "node-a", 1, address="10.0.0.1")
        register_node(client, "node-b", 1, address="10.0.0.2")
        for i in range(2):
            r = client.post("/v1/jobs", json=job_body(name=f"one-{i}", num_nodes=1, gpus_per_node=1), headers=ADMIN)
            assert r.status_code == 201, r.text
        app.state.loops.schedule_once()
        started = client.get("/v1/jobs", params={"state": "starting"}, headers=ADMIN).json()["items"]
        assert len(started) == 2
    engine = create_engine(fresh_database_url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT rdzv_host, rdzv_port FROM attempts")).all()
        assert sorted(r.rdzv_port for r in rows) == [30000, 30000] and len({r.rdzv_host for r in rows}) == 2
        job = conn.execute(text("SELECT job_id, rdzv_host FROM attempts LIMIT 1")).one()
        with pytest.raises(IntegrityError, match="uq_attempts_active_rdzv_port"):
            conn.execute(text(
                "INSERT INTO attempts (id, job_id, number, fencing_token, state, num_gpus, rdzv_host, rdzv_port) "
                "VALUES (:a, :j, 99, 't', 'starting', 1, :h, 30000)"), {"a": uuid.uuid4(), "j": job.job_id,
                                                                       "h": job.rdzv_host})
    engine.dispose()


def test_a_gang_freed_while_another_pass_holds_the_lock_is_placed_without_waiting_a_period(settings):
    """The last release of a gang runs a pass in its own thread; if another pass (another replica's,
    or the loop's) holds the lock, that pass may have read the cluster before the release
    committed. The waiting job must then be placed as soon as the lock is free, not a scheduler
    period later (here 10 minutes: before the fix it waited all of it)."""
    app = create_app(settings.model_copy(update={"run_loops": True, "scheduler_interval_s": 600.0,
                                                 "monitor_interval_s": 600.0}))
    with TestClient(app) as c:
        agent = FakeAgentSession(c, "n1", gpus=2)
        first = c.post("/v1/jobs", json=job_body(name="first", num_nodes=1), headers=ADMIN).json()
        wait_for(lambda: agent.heartbeat()["assignments"], 15, what="the first job's part")
        [spec] = agent.heartbeat()["assignments"]
        second = c.post("/v1/jobs", json=job_body(name="second", num_nodes=1), headers=ADMIN).json()
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
        holder = create_engine(settings.database_url)
        with holder.connect() as conn:  # another replica's pass, holding the lock
            conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": allocate.SCHEDULER_LOCK})
            done = agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0),
                                processes_alive=False)  # a final report: it releases the GPUs
            assert done.status_code == 200 and done.json()["released"], done.text
            time.sleep(0.5)  # the release's own pass and the loop's first retry found the lock taken
            assert c.get(f"/v1/jobs/{second['id']}", headers=ADMIN).json()["current_attempt"] is None
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": allocate.SCHEDULER_LOCK})
        holder.dispose()
        assert c.get(f"/v1/jobs/{first['id']}", headers=ADMIN).json()["state"] == "succeeded"
        wait_for(lambda: c.get(f"/v1/jobs/{second['id']}", headers=ADMIN).json()["current_attempt"] is not None,
                 15, what="the second job placed once the lock was free")
