"""Alembic migrations and the SQLAlchemy models describe the same schema; the database
itself enforces the allocation invariants."""

from __future__ import annotations

import uuid

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from control_plane.models import Base


def test_autogenerate_finds_no_difference(fresh_database_url):
    engine = create_engine(fresh_database_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        diff = compare_metadata(ctx, Base.metadata)
    engine.dispose()
    assert diff == []


def _seed(conn, gpus: int = 2):
    node = uuid.uuid4()
    conn.execute(text("INSERT INTO nodes (id, name, address, state, token_hash) VALUES (:i, :n, 'a', 'ready', 'h')"),
                 {"i": node, "n": f"n-{node.hex[:6]}"})
    gpu_ids = []
    for i in range(gpus):
        g = uuid.uuid4()
        conn.execute(text("INSERT INTO gpus (id, node_id, index, uuid, kind) VALUES (:g, :n, :i, :u, 'k')"),
                     {"g": g, "n": node, "i": i, "u": str(g)})
        gpu_ids.append(g)
    job = uuid.uuid4()
    conn.execute(text(
        "INSERT INTO jobs (id, name, principal, state, num_nodes, gpus_per_node, entrypoint, max_failures) "
        "VALUES (:j, 'j', 'admin', 'starting', 1, 2, 'm', 0)"), {"j": job})
    return node, gpu_ids, job


def _attempt(conn, job, num_gpus, port):
    a = uuid.uuid4()
    conn.execute(text(
        "INSERT INTO attempts (id, job_id, number, fencing_token, state, num_gpus, rdzv_host, rdzv_port) "
        "VALUES (:a, :j, :n, 't', 'starting', :g, 'h', :p)"),
        {"a": a, "j": job, "n": port, "g": num_gpus, "p": port})
    return a


def _lease(conn, gpu, node, attempt, job):
    conn.execute(text("INSERT INTO gpu_leases (id, gpu_id, node_id, attempt_id, job_id) VALUES (:i, :g, :n, :a, :j)"),
                 {"i": uuid.uuid4(), "g": gpu, "n": node, "a": attempt, "j": job})


def test_database_refuses_partial_gang(fresh_database_url):
    engine = create_engine(fresh_database_url)
    with pytest.raises(IntegrityError, match="partial gang allocation"), engine.begin() as conn:
        node, gpus, job = _seed(conn)
        attempt = _attempt(conn, job, num_gpus=2, port=1)
        _lease(conn, gpus[0], node, attempt, job)  # only one of two GPUs
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM gpu_leases")).scalar() == 0
    engine.dispose()


def test_database_refuses_double_lease(fresh_database_url):
    engine = create_engine(fresh_database_url)
    with engine.begin() as conn:
        node, gpus, job = _seed(conn)
        a1 = _attempt(conn, job, num_gpus=2, port=1)
        _lease(conn, gpus[0], node, a1, job)
        _lease(conn, gpus[1], node, a1, job)
    with pytest.raises(IntegrityError, match="uq_gpu_leases_active_gpu"), engine.begin() as conn:
        a2 = _attempt(conn, job, num_gpus=1, port=2)
        _lease(conn, gpus[0], node, a2, job)
    engine.dispose()


def test_gang_check_counts_each_attempt_and_still_refuses_a_partial_one(fresh_database_url):
    """The check counts an attempt once per commit (0004): interleaved gangs are still checked
    one by one, and a lease added after an early (IMMEDIATE) check is checked again at commit."""
    engine = create_engine(fresh_database_url)
    with pytest.raises(IntegrityError, match=r"holds 1 of 2"), engine.begin() as conn:
        node, gpus, job = _seed(conn, gpus=4)
        a, b = _attempt(conn, job, num_gpus=2, port=1), _attempt(conn, job, num_gpus=2, port=2)
        _lease(conn, gpus[0], node, a, job)
        _lease(conn, gpus[1], node, b, job)
        _lease(conn, gpus[2], node, a, job)  # a is whole, b is not
    with pytest.raises(IntegrityError, match=r"holds 3 of 2"), engine.begin() as conn:
        node, gpus, job = _seed(conn, gpus=3)
        a = _attempt(conn, job, num_gpus=2, port=3)
        _lease(conn, gpus[0], node, a, job)
        _lease(conn, gpus[1], node, a, job)
        conn.execute(text("SET CONSTRAINTS ALL IMMEDIATE"))  # checked now: whole
        conn.execute(text("SET CONSTRAINTS ALL DEFERRED"))
        _lease(conn, gpus[2], node, a, job)  # one too many: checked again at commit
    with engine.begin() as conn:  # a whole gang of many leases commits
        node, gpus, job = _seed(conn, gpus=8)
        a = _attempt(conn, job, num_gpus=8, port=4)
        for g in gpus:
            _lease(conn, g, node, a, job)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM gpu_leases")).scalar() == 8
    engine.dispose()


def test_downgrade_to_0003_and_back(fresh_database_url):
    from alembic import command

    from control_plane.db import alembic_config

    cfg = alembic_config(fresh_database_url)
    command.downgrade(cfg, "0003")
    engine = create_engine(fresh_database_url)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT to_regclass('tenants')")).scalar() is None
    command.upgrade(cfg, "head")
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()


def _schema_names(conn) -> set[str]:
    return set(conn.execute(text(
        "SELECT conname FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace "
        "WHERE n.nspname = current_schema() UNION SELECT indexname FROM pg_indexes "
        "WHERE schemaname = current_schema() UNION SELECT tablename FROM pg_tables "
        "WHERE schemaname = current_schema()")).scalars())


def test_every_name_the_migrations_give_is_the_models_name(fresh_database_url):
    """Renames (attempt_nodes -> attempt_parts) carry every constraint and index name along, up and
    down: compare_metadata checks indexes by name but foreign keys and unique constraints by columns."""
    from alembic import command

    from control_plane.db import alembic_config

    expected = set(Base.metadata.tables)
    for table in Base.metadata.tables.values():
        expected |= {c.name for c in table.constraints if c.name} | {i.name for i in table.indexes if i.name}
    engine = create_engine(fresh_database_url)
    with engine.connect() as conn:
        at_head = _schema_names(conn)
    assert expected <= at_head, sorted(expected - at_head)
    assert not [n for n in at_head if "attempt_nodes" in n or "attempt_node_id" in n]
    cfg = alembic_config(fresh_database_url)
    command.downgrade(cfg, "0240_i27_lag")
    with engine.connect() as conn:
        down = _schema_names(conn)
    assert not [n for n in down if "attempt_part" in n] and "attempt_nodes" in down
    command.upgrade(cfg, "head")
    with engine.connect() as conn:
        assert _schema_names(conn) == at_head
    engine.dispose()


def test_a_replica_whose_code_does_not_match_the_schema_is_not_ready(client, fresh_database_url):
    """Mid-upgrade: the database migrated past this replica's code (or not yet to it). A rename such
    as 0250's would answer its queries 500; /readyz says so first, naming both revisions and what to
    do, so the load balancer sends it nothing."""
    from control_plane.db import code_schema_version

    head = code_schema_version()
    assert client.get("/readyz").json() == {"status": "ready", "schema": head}
    engine = create_engine(fresh_database_url)
    try:
        for other in ("0240_i27_lag", "9999_from_a_newer_release"):
            with engine.begin() as conn:
                conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": other})
            r = client.get("/readyz")
            assert r.status_code == 503 and r.headers["content-type"].startswith("application/problem+json")
            detail = r.json()["detail"]
            assert other in detail and head in detail and "trainyard migrate" in detail, detail
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
        assert client.get("/readyz").status_code == 200
    finally:
        engine.dispose()
