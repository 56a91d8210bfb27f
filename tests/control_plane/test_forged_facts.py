"""Facts only their owner may state (issue 11, finding 12): a worker cannot write a control-plane
event, a node speaks only for its own ranks, only the node running global rank 0 sets the job's
result, and a shard key is checked exactly."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


@pytest.fixture
def gang(client):
    agents = [FakeAgentSession(client, "node-1", 2), FakeAgentSession(client, "node-2", 2)]
    job = client.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
    client.app.state.loops.schedule_once()
    specs = {}
    for agent in agents:
        spec = agent.heartbeat()["assignments"][0]
        specs[spec["node_rank"]] = (agent, spec)
    return client, job, specs


def _events(client, job) -> list[dict]:
    return client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}, headers=ADMIN).json()["items"]


def test_a_worker_cannot_post_a_control_plane_event(gang):
    client, job, specs = gang
    agent, spec = specs[0]
    for kind in ("checkpoint.committed", "checkpoint.aborted", "checkpoint.deleted"):
        r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
            "fencing_token": spec["fencing_token"], "node_rank": 0,
            "events": [{"rank": 0, "kind": kind, "message": "forged", "data": {"step": 10}}]})
        assert r.status_code == 422, r.text
    ok = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
        "fencing_token": spec["fencing_token"], "node_rank": 0,
        "events": [{"rank": 0, "kind": "job.succeeded", "message": "not really"}]})
    assert ok.status_code == 200
    kinds = [e["kind"] for e in _events(client, job)]
    assert "worker.job.succeeded" in kinds and "job.succeeded" not in kinds
    assert not [k for k in kinds if k in ("checkpoint.committed", "checkpoint.aborted", "checkpoint.deleted")]


def test_every_checkpoint_event_the_worker_runtime_sends_is_taken_under_its_own_name(gang):
    """A worker's ``checkpoint.skipped`` and ``checkpoint.upload_unslotted`` were refused (422) as
    control-plane kinds: the local API dropped them and the worker logged "events report not
    delivered" (found by tests/e2e/test_user_resume.py). Every kind notify.py sends is the worker's."""
    from trainyard.protocol.agent import LocalEvent
    from worker_runtime.checkpoint import notify

    sent = {v for k, v in vars(notify).items() if k.isupper() and isinstance(v, str) and v.startswith("checkpoint.")}
    assert {"checkpoint.skipped", "checkpoint.upload_unslotted"} <= sent
    client, job, specs = gang
    agent, spec = specs[0]
    # Not checkpoint.restored: it stands for a restore (and sets the attempt's restored step).
    kinds = sorted(sent - {"checkpoint.restored"})
    for kind in kinds:
        LocalEvent(fencing_token=spec["fencing_token"], rank=0, kind=kind, message="m")  # the agent's local API
        r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
            "fencing_token": spec["fencing_token"], "node_rank": 0,
            "events": [{"rank": 0, "kind": kind, "message": kind, "data": {"step": 10}}]})
        assert r.status_code == 200, (kind, r.text)
    recorded = {e["kind"] for e in _events(client, job)}
    assert {"checkpoint.skipped", "checkpoint.upload_unslotted"} <= recorded, recorded


def test_a_node_reports_only_its_own_ranks_and_only_rank_0_sets_the_result(gang):
    client, job, specs = gang
    (a, sa), (b, sb) = specs[0], specs[1]
    # torchrun's c10d rendezvous may give node rank 1 the global ranks 0-1: whoever reports a block
    # first owns it. Here node rank 1 does.
    assert b.status(sb, "running", workers=workers_for(sa, "running")).status_code == 200
    stolen = a.status(sa, "running", workers=workers_for(sa, "running"))
    assert stolen.status_code == 403 and "another node" in stolen.json()["detail"]
    mixed = [*workers_for(sb, "running")[:1], *workers_for(sa, "running")[:1]]  # ranks 2 and 0: two blocks
    assert a.status(sa, "running", workers=mixed).status_code == 403
    outside = [{"rank": 9, "local_rank": 1, "pid": 1, "state": "running"}]
    assert a.status(sa, "running", workers=outside).status_code == 403
    assert a.status(sa, "running", workers=workers_for(sb, "running")).status_code == 200  # ranks 2-3: its own

    # The result: only from the node that runs global rank 0 (node rank 1 here).
    forged = a.status(sa, "exited", exit_code=0, workers=workers_for(sb, "exited", 0), result={"loss": 0.0})
    assert forged.status_code == 403 and "global rank 0" in forged.json()["detail"]
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["result"] is None
    real = b.status(sb, "exited", exit_code=0, workers=workers_for(sa, "exited", 0), result={"loss": 1.5})
    assert real.status_code == 200, real.text
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["result"] == {"loss": 1.5}


def test_shard_keys_are_checked_exactly_and_ranks_are_the_nodes_own(gang):
    client, job, specs = gang
    (a, sa), (b, sb) = specs[0], specs[1]
    assert a.status(sa, "running", workers=workers_for(sa, "running")).status_code == 200
    own = f"jobs/{job['id']}/checkpoints/step-000000010/attempt-0001/rank-00000.pt"

    def shard(rank: int, key: str) -> dict:
        return {"rank": rank, "step": 10, "world_size": 4, "key": key, "size_bytes": 1, "sha256": "0" * 64}

    def report(agent, spec, *shards):
        return client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers, json={
            "fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"], "shards": list(shards)})

    for key in (f"jobs/{job['id']}/checkpoints/step-000000010/attempt-0001/../../../../other/rank-00000.pt",
                f"jobs/{job['id']}/checkpoints/step-000000010/attempt-0001/rank-00000.pt.extra",
                f"jobs/{job['id']}/checkpoints/step-000000010/attempt-0001//rank-00000.pt",
                own.replace("rank-00000", "rank-00001")):
        r = report(a, sa, shard(0, key))
        assert r.status_code == 409 and "not this attempt's key" in r.json()["detail"], (key, r.text)
    stolen = report(b, sb, shard(0, own))  # rank 0 is node rank 0's worker
    assert stolen.status_code == 403 and "another node" in stolen.json()["detail"]
    assert client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=ADMIN).json()["items"] == []
    assert report(a, sa, shard(0, own)).status_code == 200
