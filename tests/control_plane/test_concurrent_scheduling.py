"""Scheduling passes run concurrently (as several replicas would) never allocate a GPU twice."""

from __future__ import annotations

import threading

from sqlalchemy import create_engine, text

from control_plane.db import make_engine, make_session_factory
from control_plane.scheduler.allocate import schedule_pass
from tests.factories import ADMIN, job_body, register_node


def test_parallel_passes_never_double_allocate(client, settings):
    for i in range(4):
        register_node(client, f"node-{i}", 2)
    for i in range(12):
        client.post("/v1/jobs", json=job_body(name=f"j{i}", num_nodes=1 + i % 2, gpus_per_node=1 + i % 2),
                    headers=ADMIN)

    engines = [make_engine(settings.database_url, pool_size=2) for _ in range(4)]
    factories = [make_session_factory(e) for e in engines]
    admitted: list[int] = []
    barrier = threading.Barrier(len(factories))

    def replica(factory) -> None:
        barrier.wait()
        for _ in range(5):
            s = factory()
            try:
                admitted.append(len(schedule_pass(s, settings)))
            finally:
                s.close()

    threads = [threading.Thread(target=replica, args=(f,)) for f in factories]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for e in engines:
        e.dispose()

    engine = create_engine(settings.database_url)
    with engine.connect() as conn:
        dup = conn.execute(text(
            "SELECT gpu_id FROM gpu_leases WHERE released_at IS NULL GROUP BY gpu_id HAVING count(*) > 1"
        )).all()
        leased = conn.execute(text("SELECT count(*) FROM gpu_leases WHERE released_at IS NULL")).scalar()
        partial = conn.execute(text(
            "SELECT a.id FROM attempts a LEFT JOIN gpu_leases l ON l.attempt_id = a.id "
            "GROUP BY a.id, a.num_gpus HAVING count(l.id) <> a.num_gpus"
        )).all()
        per_job = conn.execute(text(
            "SELECT job_id FROM attempts WHERE state IN ('starting','running') GROUP BY job_id HAVING count(*) > 1"
        )).all()
    engine.dispose()
    assert dup == [] and partial == [] and per_job == []
    started = client.get("/v1/jobs", params={"state": "starting"}, headers=ADMIN).json()["items"]
    assert started and sum(admitted) == len(started)  # each decision applied exactly once
    assert leased == sum(j["num_nodes"] * j["gpus_per_node"] for j in started) <= 8
