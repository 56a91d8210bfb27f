"""Bad values at every boundary are refused with a 4xx, never a 500 (issue 11, finding 10): strict
integers, NUL characters, integers past their columns, non-ASCII tokens, oversized bodies."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body, register_body, workers_for

JOIN = {"Authorization": "Bearer test-join-token"}
BIG = 2**31


@pytest.fixture
def running(client):
    agents = [FakeAgentSession(client, "node-1", 2), FakeAgentSession(client, "node-2", 2)]
    job = client.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
    client.app.state.loops.schedule_once()
    specs = [a.heartbeat()["assignments"][0] for a in agents]
    for agent, spec in zip(agents, specs, strict=True):
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    return client, agents, specs, job


@pytest.mark.parametrize(("body", "field"), [
    ({"priority": False}, "priority"),
    ({"num_nodes": True}, "num_nodes"),
    ({"max_failures": "3"}, "max_failures"),
    ({"gpus_per_node": 1.0}, "gpus_per_node"),
    ({"args": ["ok", "bad\x00arg"]}, "args"),
    ({"args": ["x"] * 1001}, "args"),
    ({"args": ["x" * (32 * 1024 + 1)]}, "args"),
    ({"args": ["x" * 4000] * 17}, "args"),
    ({"gpu_kind": "h100\x00"}, "gpu_kind"),
    ({"name": "a\x00b"}, "name"),
    ({"entrypoint": "train\x00.py"}, "entrypoint"),
    ({"env": {"A": "b\x00"}}, "env"),
    ({"tenant": "x\x00"}, "tenant"),
])
def test_submit_refuses_bad_values_with_422(client, body, field):
    r = client.post("/v1/jobs", json=job_body(**body), headers=ADMIN)
    assert r.status_code == 422, r.text
    assert any(e["field"].startswith(field) for e in r.json()["errors"]), r.json()


def test_query_and_header_limits_are_422(client):
    FakeAgentSession(client, "node-1", 2)
    job = client.post("/v1/jobs", json=job_body(num_nodes=1), headers=ADMIN).json()
    empty = client.post("/v1/jobs", json=job_body(num_nodes=1), headers={**ADMIN, "Idempotency-Key": ""})
    assert empty.status_code == 422, empty.text
    assert client.post("/v1/jobs", json=job_body(num_nodes=1), headers=ADMIN).status_code == 201  # nothing stuck
    for path, params in [
        (f"/v1/jobs/{job['id']}/events", {"after": "49314103616175620096"}),
        (f"/v1/jobs/{job['id']}/logs", {"attempt": str(BIG)}),
        (f"/v1/jobs/{job['id']}/logs", {"rank": str(BIG)}),
        (f"/v1/jobs/{job['id']}/attempts", {"cursor": "bm90IGEgY3Vyc29y"}),
        (f"/v1/jobs/{job['id']}/checkpoints", {"cursor": "W10="}),
        ("/v1/jobs", {"cursor": "%%%"}),
    ]:
        r = client.get(path, params=params, headers=ADMIN)
        assert r.status_code == 422, (path, params, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
    for bad in ({"gpu_quota": False}, {"weight": True}, {"max_priority": 10.5}):
        assert client.put("/v1/tenants/vision", json=bad, headers=ADMIN).status_code == 422, bad
    assert client.put("/v1/tenants/vision", json={"weight": 2, "gpu_quota": 4}, headers=ADMIN).status_code == 200


def test_bodies_over_the_limit_are_413(app, client):
    limit = app.state.settings.max_request_bytes
    big = b'{"name": "' + b"x" * limit + b'"}'
    r = client.post("/v1/jobs", content=big, headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.headers["content-type"].startswith("application/problem+json")

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    r = client.post("/v1/jobs", content=chunks(), headers={**ADMIN, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text


def test_agent_messages_with_bad_values_are_refused_never_500(running):
    client, agents, specs, job = running
    agent, spec = agents[0], specs[0]
    url = f"/v1/agent/attempts/{spec['attempt_id']}"
    base = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"]}
    at = "2026-12-02T12:00:00Z"
    cases = [
        ("status", {**base, "state": "running", "progress": {"step": BIG, "at": at}}, 422),
        ("status", {**base, "state": "running", "progress": {"step": 1, "loss": "NaN", "at": at}}, 422),
        ("status", {**base, "state": "running", "result": {"k": "v\x00"}}, 422),
        ("status", {**base, "state": "running", "result": {"blob": "x" * 20000}}, 422),
        ("status", {**base, "state": "running", "exit_code": 2**40}, 422),
        ("status", {**base, "state": "running", "workers": [{"rank": 0, "local_rank": 0, "pid": 2**40,
                                                               "state": "running"}]}, 422),
        ("status", {**base, "fencing_token": "t\u00f6ken", "state": "running"}, 409),
        ("status", {**base, "node_rank": BIG, "state": "running"}, 422),
        ("logs", {**base, "chunks": [{"rank": BIG, "stream": "stdout", "offset": 0, "data": "x"}]}, 422),
        ("logs", {**base, "chunks": [{"rank": 0, "stream": "stdout", "offset": 2**63, "data": "x"}]}, 422),
        ("events", {**base, "events": [{"rank": 0, "kind": "note", "message": "a\x00b"}]}, 422),
        ("events", {**base, "events": [{"rank": 0, "kind": "note", "message": "m", "data": {"\x00": 1}}]}, 422),
        ("events", {**base, "events": [{"rank": 0, "kind": "note", "message": "m", "data": {"x": "y" * 17000}}]},
         422),
        ("shards", {**base, "shards": [{"rank": 0, "step": 1, "world_size": 4, "key": "k\x00",
                                        "size_bytes": 1, "sha256": "0" * 64}]}, 409),
        ("shards", {**base, "shards": [{"rank": 0, "step": BIG, "world_size": 4, "key": "k",
                                        "size_bytes": 1, "sha256": "0" * 64}]}, 422),
    ]
    for kind, body, expected in cases:
        r = client.post(f"{url}/{kind}", json=body, headers=agent.headers)
        assert r.status_code == expected, (kind, body if len(str(body)) < 300 else kind, r.text[:300])
        assert r.headers["content-type"].startswith("application/problem+json")
    # A NUL in an error or a log line is dropped, not refused: the agent wrote them, not a worker.
    r = client.post(f"{url}/status", json={**base, "state": "running", "error": "bad\x00thing"}, headers=agent.headers)
    assert r.status_code == 200, r.text
    r = client.post(f"{url}/logs", json={**base, "chunks": [{"rank": 0, "stream": "stdout", "offset": 0,
                                                             "data": "a\x00b\n"}]}, headers=agent.headers)
    assert r.status_code == 200 and client.get(f"/v1/jobs/{job['id']}/logs", headers=ADMIN).text.endswith("ab\n")


@pytest.mark.parametrize(("override", "expected"), [
    ({"address": "a" * 256}, 422),
    ({"name": "bad\x00name"}, 422),
    ({"labels": {"rack": "r\x00"}}, 422),
    ({"agent_version": "1\x00"}, 422),
    ({"agent_instance": "i" * 65}, 422),
    ({"gpus": [{"index": BIG, "uuid": "u", "kind": "k", "memory_mb": 0}]}, 422),
    ({"gpus": [{"index": 0, "uuid": "u\x00", "kind": "k", "memory_mb": 0}]}, 422),
])
def test_register_refuses_bad_values(client, override, expected):
    r = client.post("/v1/agent/register", json={**register_body("gpu-x", 1), **override}, headers=JOIN)
    assert r.status_code == expected, r.text


def test_heartbeat_refuses_bad_values(client):
    agent = FakeAgentSession(client, "node-1", 1)
    for body in ({"agent_instance": "i" * 65, "seq": 1}, {"agent_instance": "i", "seq": 2**63},
                 {"agent_instance": "i\x00", "seq": 1}, {"agent_instance": "i", "seq": 1,
                                                        "attempts": [{"attempt_id": "a" * 200}]}):
        r = client.post("/v1/agent/heartbeat", json=body, headers=agent.headers)
        assert r.status_code == 422, r.text
    odd = {"Authorization": "Bearer t\u00f6ken".encode()}  # a non-ASCII token: compared as bytes, never a 500
    assert client.post("/v1/agent/heartbeat", json={"agent_instance": "i", "seq": 1}, headers=odd).status_code == 401
    assert client.get("/v1/jobs", headers=odd).status_code == 401
    assert client.post("/v1/agent/register", json=register_body("gpu-y", 1), headers=odd).status_code == 401


def test_a_simulation_interval_too_small_to_count_saves_is_a_422_not_a_500(client):
    """schemathesis found it: interval_s of 2e-309 made work / interval infinite (OverflowError, 500)."""
    body = {"nodes": 8, "node_mtbf_h": 1000, "blocking_s": 5, "interval_s": 2.225073858507203e-309}
    r = client.post("/v1/simulations", json=body, headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text
