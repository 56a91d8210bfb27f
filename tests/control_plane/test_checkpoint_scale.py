"""Finding 21 (the commit path): a checkpoint of 1,024 shards, reported by its nodes at once, on real
PostgreSQL and a real S3 server. Every report is accepted and the step commits exactly once; shard
reports of one job do not wait for each other (they share the job and attempt rows, the exclusive
lock is for changes of state), and one S3 listing checks every shard's key and size."""

from __future__ import annotations

import functools
import hashlib
import io
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select, text

from control_plane.app import create_app, object_store
from control_plane.models import Checkpoint, Node
from control_plane.services.checkpoints import checkpoints
from control_plane.services.checkpoints.checkpoints import checkpoint_prefix
from control_plane.settings import Settings
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from trainyard.protocol.agent import ShardReport

STEP = 100


@pytest.fixture
def s3_settings(settings: Settings, s3_bucket) -> Settings:
    return settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket,
    })


class World:
    """A job of ``nodes`` x ``gpus`` ranks held by fake agents speaking the real wire protocol."""

    def __init__(self, client: TestClient, nodes: int, gpus: int, *, prefix: str = "node") -> None:
        self.client = client
        self.world = nodes * gpus
        self.agents = [FakeAgentSession(client, f"{prefix}-{i:03d}", gpus) for i in range(nodes)]
        self.job = client.post("/v1/jobs", json=job_body(num_nodes=nodes, gpus_per_node=gpus, max_failures=2),
                               headers=ADMIN).json()
        client.app.state.loops.schedule_once()
        self.specs = [a.heartbeat()["assignments"][0] for a in self.agents]
        assert {s["attempt_number"] for s in self.specs} == {1}
        self.store = object_store(client.app.state.settings)
        assert self.store is not None

    def shard(self, spec: dict, local: int, *, upload: bool = True, size: int | None = None) -> dict:
        rank = spec["node_rank"] * spec["nproc_per_node"] + local
        data = f"{spec['attempt_id']}:{rank}:".encode().ljust(64, b".")
        key = f"{checkpoint_prefix(self.job['id'], STEP, 1)}/rank-{rank:05d}.pt"
        if upload:
            self.store.put_object(key, io.BytesIO(data), length=len(data))
        return {"rank": rank, "step": STEP, "world_size": self.world, "key": key,
                "size_bytes": size if size is not None else len(data), "sha256": hashlib.sha256(data).hexdigest()}

    def report(self, i: int, *shards: dict):
        agent, spec = self.agents[i], self.specs[i]
        return self.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                                json={"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                                      "shards": list(shards)})

    def body(self, i: int, *shards: dict) -> ShardReport:
        spec = self.specs[i]
        return ShardReport.model_validate({"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                                           "shards": list(shards)})

    def checkpoints(self) -> list[dict]:
        return self.client.get(f"/v1/jobs/{self.job['id']}/checkpoints", headers=ADMIN).json()["items"]

    def events(self, kind: str) -> int:
        items = self.client.get(f"/v1/jobs/{self.job['id']}/events", params={"limit": 1000},
                                headers=ADMIN).json()["items"]
        return [e["kind"] for e in items].count(kind)


def test_1024_shard_reports_at_once_are_all_accepted_and_commit_once(s3_settings):
    with TestClient(create_app(s3_settings)) as client:
        w = World(client, nodes=128, gpus=8)
        with ThreadPoolExecutor(16) as pool:  # every rank uploads its shard
            shards = list(pool.map(lambda ij: w.shard(w.specs[ij[0]], ij[1]),
                                   [(i, j) for i in range(128) for j in range(8)]))
        # 1,024 reports, one shard each, from 8 threads at once (each node's ranks report on their own).
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda k: w.report(k // 8, shards[k]), range(1024)))
        assert [r.status_code for r in responses if r.status_code != 200] == []
        assert sum(r.json()["accepted"] for r in responses) == 1024
        assert any(r.json()["committed_steps"] == [STEP] for r in responses)  # the last one committed it
        [ckpt] = w.checkpoints()
        assert ckpt["state"] == "committed" and ckpt["shards"] == 1024
        assert w.events("checkpoint.committed") == 1 and w.events("checkpoint.begun") == 1
        with client.app.state.session_factory() as s:
            assert s.scalar(select(Checkpoint.shards_received).where(Checkpoint.id == uuid.UUID(ckpt["id"]))) == 1024
        # Resent reports change nothing and are acknowledged as committed.
        again = w.report(3, *shards[24:32]).json()
        assert again == {"accepted": 8, "committed_steps": [STEP]}
        checkpoints.maintenance(client.app.state.session_factory, w.store, pending_timeout_s=600.0)
        assert w.events("checkpoint.committed") == 1


def test_shard_reports_of_one_job_do_not_wait_for_each_other(s3_settings):
    """Two shard reports of one attempt in two open transactions: the second completes while the
    first has not committed (the old code locked the job row FOR NO KEY UPDATE for each report)."""
    with TestClient(create_app(s3_settings)) as client:
        w = World(client, nodes=2, gpus=2)
        factory = client.app.state.session_factory
        assert w.report(0, w.shard(w.specs[0], 0)).status_code == 200  # the step's checkpoint exists
        held = factory()
        try:
            arrived = checkpoints.record_shards(held, held.get(Node, uuid.UUID(w.agents[0].node_id)),
                                                uuid.UUID(w.specs[0]["attempt_id"]), w.body(0, w.shard(w.specs[0], 1)))
            holder_pid = held.scalar(text("SELECT pg_backend_pid()"))
            done = threading.Event()
            errors: list[BaseException] = []

            def other() -> None:
                try:
                    with factory() as s:
                        mine = checkpoints.record_shards(s, s.get(Node, uuid.UUID(w.agents[1].node_id)),
                                                         uuid.UUID(w.specs[1]["attempt_id"]),
                                                         w.body(1, w.shard(w.specs[1], 0)))
                        s.commit()
                    with factory() as s:  # as the route does, after its commit
                        checkpoints.count_arrivals(s, mine)
                        s.commit()
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    done.set()

            t = threading.Thread(target=other, daemon=True)
            t.start()
            # Either it completes, or it shows up waiting for the held transaction's lock.
            blocked = False
            deadline = time.monotonic() + 120
            with factory() as probe:
                while not done.wait(0.1) and time.monotonic() < deadline:
                    blocked = bool(probe.scalar(text(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND :pid = ANY(pg_blocking_pids(pid))"), {"pid": holder_pid}))
                    probe.rollback()
                    if blocked:
                        break
            assert not blocked, "a shard report waited for another report's transaction"
            assert done.is_set() and errors == []
            held.commit()
            with factory() as s:
                checkpoints.count_arrivals(s, arrived)
                s.commit()
        finally:
            held.rollback()
            held.close()
        t.join(60)
        assert [c["shards"] for c in w.checkpoints()] == [3]
        assert w.report(1, w.shard(w.specs[1], 1)).json()["committed_steps"] == [STEP]
        assert w.events("checkpoint.committed") == 1


def test_the_commit_checks_every_shard_size_from_the_listing(s3_settings):
    with TestClient(create_app(s3_settings)) as client:
        w = World(client, nodes=2, gpus=2)
        w.report(0, w.shard(w.specs[0], 0), w.shard(w.specs[0], 1))
        w.report(1, w.shard(w.specs[1], 0))
        # Rank 3's object exists under the prefix, but not with the size reported.
        r = w.report(1, w.shard(w.specs[1], 1, size=65))
        assert r.json()["committed_steps"] == []
        [ckpt] = w.checkpoints()
        assert ckpt["state"] == "aborted" and "rank 3 is missing or has the wrong size" in ckpt["reason"]


def _rows_read(client: TestClient, send) -> int:
    """Rows the control plane's SELECTs return while ``send()`` runs (one request)."""
    engine = client.app.state.engine
    counted: list[int] = []

    def after(conn, cursor, statement, parameters, context, executemany) -> None:
        if statement.lstrip().upper().startswith("SELECT") and cursor.rowcount > 0:
            counted.append(cursor.rowcount)

    event.listen(engine, "after_cursor_execute", after)
    try:
        r = send()
    finally:
        event.remove(engine, "after_cursor_execute", after)
    assert r.status_code == 200, r.text
    return sum(counted)


def test_the_rows_a_report_reads_do_not_grow_with_the_world(s3_settings):
    """The cost of one node's shard or status report is O(its own ranks): the rank-ownership check
    (fencing.check_own_ranks) read every worker of the attempt, so each of a 1,024-rank gang's 128
    reports read 1,024 rows (most of a report's cost in bench/scale.py). The same report in a world
    four times larger reads the same rows."""
    read = {}
    with TestClient(create_app(s3_settings)) as client:
        for nodes in (2, 8):
            w = World(client, nodes=nodes, gpus=4, prefix=f"world{nodes}")
            for agent, spec in zip(w.agents, w.specs, strict=True):  # every worker of the world is known
                assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
            agent, spec = w.agents[1], w.specs[1]
            shards = [w.shard(spec, j) for j in range(4)]
            shard = _rows_read(client, functools.partial(w.report, 1, *shards))
            status = _rows_read(client, functools.partial(agent.status, spec, "running",
                                                          workers=workers_for(spec, "running")))
            read[nodes] = (shard, status)
    assert read[8] == read[2], read
