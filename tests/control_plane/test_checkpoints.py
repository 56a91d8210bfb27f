"""Two-phase checkpoints on the control plane, against real PostgreSQL and a real S3 server: only a
checkpoint whose every shard arrived from the current attempt, for one step, and exists in S3 with
its size is ever committed; two replicas commit it once; old and aborted ones are collected."""

from __future__ import annotations

import hashlib
import io
import json
import uuid

import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app, object_store
from control_plane.db import make_engine, make_session_factory
from control_plane.services.checkpoints import checkpoints
from control_plane.services.checkpoints.checkpoints import checkpoint_prefix
from control_plane.settings import Settings
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from tests.helpers import in_parallel


@pytest.fixture
def s3_settings(settings: Settings, s3_bucket) -> Settings:
    return settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket,
    })


@pytest.fixture
def s3_client(s3_settings: Settings):
    app = create_app(s3_settings)
    with TestClient(app) as c:
        yield c


class Gang:
    """A 2-node x 1-GPU job running on fake agents that speak the real wire protocol."""

    def __init__(self, client: TestClient, body: dict | None = None) -> None:
        self.client = client
        self.agents = [FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)]
        self.job = client.post("/v1/jobs", json=body or job_body(num_nodes=2, gpus_per_node=1, max_failures=2),
                               headers=ADMIN).json()
        client.app.state.loops.schedule_once()
        self.specs = [a.heartbeat()["assignments"][0] for a in self.agents]
        self.store = object_store(client.app.state.settings)

    def spec_of_rank(self, rank: int) -> tuple[FakeAgentSession, dict]:
        agent, spec = next((a, s) for a, s in zip(self.agents, self.specs, strict=True) if s["node_rank"] == rank)
        return agent, spec

    def upload(self, step: int, rank: int, data: bytes, *, attempt: int = 1) -> dict:
        key = f"{checkpoint_prefix(self.job['id'], step, attempt)}/rank-{rank:05d}.pt"
        assert self.store is not None
        self.store.put_object(key, io.BytesIO(data), length=len(data))
        return {"rank": rank, "step": step, "world_size": 2, "key": key, "size_bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}

    def report(self, rank: int, *shards: dict, spec: dict | None = None):
        agent, own = self.spec_of_rank(rank)
        spec = spec or own
        return self.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                                json={"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                                      "shards": list(shards)})

    def checkpoints(self) -> list[dict]:
        return self.client.get(f"/v1/jobs/{self.job['id']}/checkpoints", headers=ADMIN).json()["items"]

    def maintain(self, pending_timeout_s: float = 600.0) -> None:
        checkpoints.maintenance(self.client.app.state.session_factory, self.store,
                                pending_timeout_s=pending_timeout_s)


def test_every_shard_present_commits_and_publishes_the_manifest(s3_client):
    g = Gang(s3_client)
    assert g.report(0, g.upload(20, 0, b"rank zero")).json() == {"accepted": 1, "committed_steps": []}
    assert g.checkpoints()[0]["state"] == "pending"
    ack = g.report(1, g.upload(20, 1, b"rank one!")).json()
    assert ack == {"accepted": 1, "committed_steps": [20]}
    [ckpt] = g.checkpoints()
    assert ckpt["state"] == "committed" and ckpt["size_bytes"] == 18 and ckpt["shards"] == 2
    manifest = json.load(g.store.get_object(ckpt["manifest_key"]))
    assert manifest["step"] == 20 and manifest["world_size"] == 2 and manifest["attempt_number"] == 1
    assert [s["rank"] for s in manifest["shards"]] == [0, 1]
    assert manifest["shards"][1]["sha256"] == hashlib.sha256(b"rank one!").hexdigest()


def test_the_ack_names_only_the_steps_that_committed(s3_client):
    g = Gang(s3_client)
    g.report(0, g.upload(20, 0, b"rank zero"))
    # One batch: rank 1's shard completes step 20; its shard of step 30 leaves step 30 pending.
    ack = g.report(1, g.upload(20, 1, b"rank one"), g.upload(30, 1, b"rank one, later")).json()
    assert ack == {"accepted": 2, "committed_steps": [20]}
    assert sorted((c["step"], c["state"]) for c in g.checkpoints()) == [(20, "committed"), (30, "pending")]
    # A resent shard of an already committed step is acknowledged as committed.
    assert g.report(1, g.upload(20, 1, b"rank one")).json()["committed_steps"] == [20]


def test_reported_but_missing_shard_object_aborts(s3_client):
    g = Gang(s3_client)
    g.report(0, g.upload(20, 0, b"here"))
    ghost = g.upload(20, 1, b"gone")
    g.store.delete(ghost["key"])
    assert g.report(1, ghost).json()["committed_steps"] == []
    [ckpt] = g.checkpoints()
    assert ckpt["state"] == "aborted" and "missing or has the wrong size" in ckpt["reason"]


def test_shards_of_different_steps_never_make_a_checkpoint(s3_client):
    g = Gang(s3_client)
    g.report(0, g.upload(20, 0, b"a"))
    g.report(1, g.upload(40, 1, b"b"))
    assert sorted((c["step"], c["state"], c["shards"]) for c in g.checkpoints()) == [
        (20, "pending", 1), (40, "pending", 1)]
    g.maintain(pending_timeout_s=0.0)
    assert {c["state"] for c in g.checkpoints()} == {"aborted"}


def test_refused_shards_change_nothing(s3_client):
    g = Gang(s3_client)
    good = g.upload(20, 0, b"good")
    elsewhere = {**good, "key": f"jobs/{g.job['id']}/checkpoints/step-000000020/attempt-0002/rank-00000.pt"}
    assert g.report(0, elsewhere).status_code == 409  # not under this attempt's prefix
    assert g.report(0, {**good, "world_size": 4}).status_code == 409
    assert g.report(0, {**good, "rank": 7}).status_code == 409
    agent, spec = g.spec_of_rank(0)
    r = g.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                      json={"fencing_token": "forged", "node_rank": 0, "shards": [good]})
    assert r.status_code == 409 and r.json()["type"].endswith("stale-attempt")
    assert g.checkpoints() == []
    # A resent shard is stored once; a different one for the same (step, rank) is refused.
    assert g.report(0, good).status_code == 200 and g.report(0, good).status_code == 200
    assert g.report(0, {**good, "sha256": "0" * 64}).status_code == 409
    assert [c["shards"] for c in g.checkpoints()] == [1]


def test_a_late_shard_of_a_stale_attempt_is_refused(s3_client):
    g = Gang(s3_client)
    g.report(0, g.upload(20, 0, b"old attempt, rank 0"))
    late = g.upload(20, 1, b"old attempt, rank 1")
    # Attempt 1 fails and attempt 2 starts; then rank 1's report of attempt 1 arrives.
    agent1, spec1 = g.spec_of_rank(1)
    agent1.status(spec1, "exited", exit_code=1, workers=workers_for(spec1, "exited", 1))
    for a in g.agents:
        a.heartbeat([])
    assert g.client.app.state.loops.schedule_once() == 1
    r = g.report(1, late, spec=spec1)
    assert r.status_code == 409 and "stale" in r.json()["detail"]
    g.maintain()
    [ckpt] = g.checkpoints()
    assert ckpt["attempt_number"] == 1 and ckpt["state"] == "aborted" and ckpt["shards"] == 1


def test_two_replicas_commit_a_checkpoint_once(s3_settings, s3_bucket):
    # No object store in the request path: the checkpoint waits complete and pending for phase 2.
    app = create_app(s3_settings.model_copy(update={"s3_endpoint": ""}))
    with TestClient(app) as client:
        g = Gang(client)
        g.store = object_store(s3_settings)
        g.report(0, g.upload(20, 0, b"zero"))
        g.report(1, g.upload(20, 1, b"one"))
        [ckpt] = g.checkpoints()
        assert ckpt["state"] == "pending" and ckpt["shards"] == 2
        engines = [make_engine(s3_settings.database_url, pool_size=2) for _ in range(4)]

        def replica(engine) -> bool:
            return checkpoints.commit_ready(make_session_factory(engine), g.store, uuid.UUID(ckpt["id"]))

        try:
            results = in_parallel(replica, [(e,) for e in engines])
        finally:
            for e in engines:
                e.dispose()
        assert sorted(results) == [False, False, False, True]
        assert g.checkpoints()[0]["state"] == "committed"
        events = client.get(f"/v1/jobs/{g.job['id']}/events", params={"limit": 1000}, headers=ADMIN).json()
        assert [e["kind"] for e in events["items"]].count("checkpoint.committed") == 1


def test_retention_keeps_the_last_k_and_collects_the_rest(s3_client):
    g = Gang(s3_client, job_body(num_nodes=2, gpus_per_node=1, checkpoint={"interval_steps": 10, "keep_last": 2}))
    for step in (10, 20, 30):
        g.report(0, g.upload(step, 0, b"x" * step))
        g.report(1, g.upload(step, 1, b"y" * step))
    g.report(0, g.upload(40, 0, b"never completed"))
    g.maintain(pending_timeout_s=0.0)
    states = {c["step"]: c["state"] for c in g.checkpoints()}
    assert states == {40: "aborted", 30: "committed", 20: "committed", 10: "deleted"}
    for step, gone in ((10, True), (40, True), (20, False), (30, False)):
        prefix = checkpoint_prefix(g.job["id"], step, 1) + "/"
        assert (list(g.store.list_keys(prefix)) == []) is gone, step


def test_a_rank_that_could_not_save_aborts_that_step(s3_client):
    g = Gang(s3_client)
    g.report(0, g.upload(20, 0, b"fine"))
    agent, spec = g.spec_of_rank(1)
    r = g.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
        "fencing_token": spec["fencing_token"], "node_rank": 1,
        "events": [{"rank": 1, "kind": "checkpoint.save_failed", "message": "S3 unreachable", "data": {"step": 20}}]})
    assert r.status_code == 200
    [ckpt] = g.checkpoints()
    assert ckpt["state"] == "aborted" and "rank 1 could not save: S3 unreachable" in ckpt["reason"]
    # Its late shard, should it arrive after all, does not revive it.
    g.report(1, g.upload(20, 1, b"late"))
    assert g.checkpoints()[0]["state"] == "aborted"


def _commit_one_checkpoint(client: TestClient, store, agents: list[FakeAgentSession], job: dict, step: int) -> None:
    """Every rank of the job's current attempt uploads a tiny shard of ``step`` and its node reports them."""
    specs = [a.heartbeat()["assignments"][0] for a in agents]
    world = specs[0]["nnodes"] * specs[0]["nproc_per_node"]

    def node(agent: FakeAgentSession, spec: dict) -> dict:
        shards = []
        for local in range(spec["nproc_per_node"]):
            rank = spec["node_rank"] * spec["nproc_per_node"] + local
            data = f"rank {rank} of step {step}".encode()
            key = f"{checkpoint_prefix(job['id'], step, spec['attempt_number'])}/rank-{rank:05d}.pt"
            store.put_object(key, io.BytesIO(data), length=len(data))
            shards.append({"rank": rank, "step": step, "world_size": world, "key": key, "size_bytes": len(data),
                           "sha256": hashlib.sha256(data).hexdigest()})
        r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                        json={"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"], "shards": shards})
        assert r.status_code == 200, r.text
        return r.json()

    acks = in_parallel(node, list(zip(agents, specs, strict=True)), timeout=300)
    assert [step] in [a["committed_steps"] for a in acks]


def _recover(client: TestClient, agents: list[FakeAgentSession]) -> list[dict]:
    """Rank 0's node reports its part failed; the next attempt's launch specs, and the heartbeat
    responses that carried them."""
    first = [a.heartbeat()["assignments"][0] for a in agents]
    agents[0].status(first[0], "exited", exit_code=1, workers=workers_for(first[0], "exited", 1))
    for a in agents:
        a.heartbeat([])
    assert client.app.state.loops.schedule_once() == 1
    return [a.heartbeat() for a in agents]


def test_the_restore_plan_does_not_grow_with_the_world_size(s3_client, tmp_path):
    """512 ranks (8 nodes x 64): the plan that reaches every worker as TRAINYARD_RESTORE_FROM, and
    the heartbeat that carries it, are as small as for 1 rank; workers read the manifest from S3."""
    from node_agent.part.commands import AttemptPaths, NodeContext, worker_env
    from trainyard.protocol.agent import LaunchSpec

    store = object_store(s3_client.app.state.settings)
    sizes = {}
    for nodes, gpus in ((1, 1), (8, 64)):
        agents = [FakeAgentSession(s3_client, f"w{nodes}-{i}", gpus) for i in range(nodes)]
        job = s3_client.post("/v1/jobs", json=job_body(num_nodes=nodes, gpus_per_node=gpus, max_failures=2),
                             headers=ADMIN).json()
        assert s3_client.app.state.loops.schedule_once() == 1
        _commit_one_checkpoint(s3_client, store, agents, job, step=100)
        [ckpt] = s3_client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=ADMIN).json()["items"]
        assert ckpt["state"] == "committed" and ckpt["shards"] == nodes * gpus
        responses = _recover(s3_client, agents)
        spec = responses[0]["assignments"][0]
        assert spec["attempt_number"] == 2
        assert len(json.dumps(spec["restore_from"])) < 1024  # 512 whole shard entries were ~60 KB
        [candidate] = spec["restore_from"]["candidates"]
        assert candidate["checkpoint_id"] == ckpt["id"] and candidate["step"] == 100
        # The reference leads to the manifest the commit wrote, and the plan can verify it.
        raw = store.get_object(candidate["manifest_key"]).read()
        assert hashlib.sha256(raw).hexdigest() == candidate["manifest_sha256"]
        assert len(raw) == candidate["manifest_size_bytes"]
        assert len(json.loads(raw)["shards"]) == nodes * gpus
        env = worker_env(LaunchSpec.model_validate(spec), NodeContext(local_addr="127.0.0.1", agent_url="http://a:1",
                                                                      virtual=True, base_env={}),
                         AttemptPaths(tmp_path))
        sizes[nodes * gpus] = (len(env["TRAINYARD_RESTORE_FROM"]), max(len(json.dumps(r)) for r in responses))
    (env_1, _), (env_512, beat_512) = sizes[1], sizes[512]
    # The same reference whatever the world size (a few more digits in world_size and manifest size).
    assert env_1 < 1024 and env_512 - env_1 < 16, sizes
    # A node's heartbeat grows only with its own ranks (its 64 GPU indices), not the job's 512.
    assert beat_512 < 4096, sizes


def _next_attempt(g: Gang) -> dict | None:
    """Attempt n fails (a rank exits 1, on alternating nodes so that neither is blamed twice);
    attempt n+1 is launched: its restore plan."""
    agent, spec = g.spec_of_rank(g.specs[0]["attempt_number"] % 2)
    agent.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
    for a in g.agents:
        a.heartbeat([])
    assert g.client.app.state.loops.schedule_once() == 1
    g.specs = [a.heartbeat()["assignments"][0] for a in g.agents]
    return g.specs[0]["restore_from"]


def _save(g: Gang, step: int, *, ranks: tuple[int, ...] = (0, 1)) -> None:
    attempt = g.specs[0]["attempt_number"]
    for rank in ranks:
        assert g.report(rank, g.upload(step, rank, f"{rank}@{step}".encode(), attempt=attempt)).status_code == 200


def _worker_event(g: Gang, kind: str, data: dict, message: str = "") -> None:
    agent, spec = g.spec_of_rank(0)
    r = g.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
        "fencing_token": spec["fencing_token"], "node_rank": 0,
        "events": [{"rank": 0, "kind": kind, "message": message or kind, "data": data}]})
    assert r.status_code == 200, r.text


def _fallback(g: Gang, candidate: dict, why: str = "rank 1: shard sha256 differs from the manifest") -> None:
    """What the worker runtime reports when every rank agreed a candidate is bad."""
    _worker_event(g, "checkpoint.fallback", {"step": candidate["step"], "reason": why, "unusable": True,
                                             "checkpoint_id": candidate["checkpoint_id"]})


def _states(g: Gang) -> dict[tuple[int, int], str]:
    return {(c["attempt_number"], c["step"]): c["state"] for c in g.checkpoints()}


def _plan_steps(plan: dict | None) -> list[tuple[int, int]]:
    return [(c["attempt_number"], c["step"]) for c in (plan or {}).get("candidates", [])]


def test_keep_last_1_with_a_corrupt_shard_keeps_the_new_runs_checkpoint(s3_client):
    g = Gang(s3_client, job_body(num_nodes=2, gpus_per_node=1, max_failures=3,
                                 checkpoint={"interval_steps": 10, "keep_last": 1}))
    _save(g, 10)
    _save(g, 20)
    g.maintain()
    assert _states(g) == {(1, 10): "deleted", (1, 20): "committed"}
    plan = _next_attempt(g)
    assert _plan_steps(plan) == [(1, 20)]
    # Attempt 2 finds rank 1's shard of step 20 corrupt: no candidate left, it starts from scratch.
    _fallback(g, plan["candidates"][0])
    _worker_event(g, "checkpoint.restore_failed", {"steps": [20]}, "none of 1 checkpoint(s) could be restored")
    [bad] = [c for c in g.checkpoints() if c["step"] == 20]
    assert bad["state"] == "unusable" and "sha256 differs" in bad["reason"]
    _save(g, 5)
    g.maintain()
    assert _states(g) == {(1, 10): "deleted", (1, 20): "unusable", (2, 5): "committed"}
    assert list(g.store.list_keys(checkpoint_prefix(g.job["id"], 20, 1) + "/")) == []  # collected
    # The next recovery restores the new run's step 5, not step 0.
    assert _plan_steps(_next_attempt(g)) == [(2, 5)]


def test_two_corrupt_checkpoints_in_a_row(s3_client):
    g = Gang(s3_client, job_body(num_nodes=2, gpus_per_node=1, max_failures=3,
                                 checkpoint={"interval_steps": 10, "keep_last": 2}))
    for step in (10, 20):
        _save(g, step)
    plan = _next_attempt(g)
    assert _plan_steps(plan) == [(1, 20), (1, 10)]
    for candidate in plan["candidates"]:
        _fallback(g, candidate)
    _save(g, 4)
    _save(g, 8)
    g.maintain()
    assert _states(g) == {(1, 10): "unusable", (1, 20): "unusable", (2, 4): "committed", (2, 8): "committed"}
    plan = _next_attempt(g)
    assert _plan_steps(plan) == [(2, 8), (2, 4)]
    # A fallback for storage trouble is no evidence: the checkpoint it names stays usable.
    newest = plan["candidates"][0]["checkpoint_id"]
    _worker_event(g, "checkpoint.fallback", {"step": 8, "reason": "rank 0: storage error while downloading",
                                             "unusable": False, "checkpoint_id": newest})
    assert _states(g)[(2, 8)] == "committed"
    events = g.client.get(f"/v1/jobs/{g.job['id']}/events", params={"limit": 1000}, headers=ADMIN).json()["items"]
    assert [e["kind"] for e in events].count("checkpoint.unusable") == 2


def test_a_new_runs_lower_steps_are_the_lineage_not_superseded(s3_client):
    """Attempt 2 started from scratch while attempt 1's step 20 is still committed (its restore
    was skipped, or its fallback lost): attempt 2's step 5, and its pending step 8, are the newest
    state of the job; step 20 is not more recent for being higher."""
    g = Gang(s3_client, job_body(num_nodes=2, gpus_per_node=1, max_failures=3,
                                 checkpoint={"interval_steps": 10, "keep_last": 1}))
    _save(g, 20)
    assert _plan_steps(_next_attempt(g)) == [(1, 20)]
    _save(g, 5)
    _save(g, 8, ranks=(0,))  # in flight: rank 1's shard has not arrived yet
    g.maintain()
    assert _states(g) == {(1, 20): "deleted", (2, 5): "committed", (2, 8): "pending"}
    _save(g, 8, ranks=(1,))
    g.maintain()
    assert _states(g) == {(1, 20): "deleted", (2, 5): "deleted", (2, 8): "committed"}
    plan = _next_attempt(g)
    assert _plan_steps(plan) == [(2, 8)]
    # Attempt 3 restores it: the lineage records which checkpoint each attempt continued from.
    _worker_event(g, "checkpoint.restored", {"step": 8, "checkpoint_id": plan["candidates"][0]["checkpoint_id"]})
    with g.client.app.state.session_factory() as s:
        from control_plane.models import Attempt
        attempt = s.get(Attempt, uuid.UUID(g.specs[0]["attempt_id"]))
        assert attempt is not None
        assert str(attempt.restored_from_checkpoint_id) == plan["candidates"][0]["checkpoint_id"]


def test_the_checkpoint_state_table():
    table = checkpoints.TRANSITIONS
    assert set(table) == {"pending", "committed", "unusable", "aborted", "deleted"}
    assert all(to in table for exits in table.values() for to in exits)
    # Every state either has an exit or is terminal with its objects collected.
    assert checkpoints.TERMINAL == set(checkpoints.COLLECTED) == {"unusable", "aborted", "deleted"}
    assert table["committed"]["unusable"] == "checkpoint.unusable"
