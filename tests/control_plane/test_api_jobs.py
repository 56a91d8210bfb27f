"""Jobs API against a real Postgres: submit, list, inspect, cancel, idempotency, every 4xx."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, TINY_GPT, job_body, register_node


@pytest.fixture
def cluster(client):
    register_node(client, "node-1", 2)
    register_node(client, "node-2", 2)
    return client


def test_submit_exact_readme_example(cluster):
    r = cluster.post("/v1/jobs", json=TINY_GPT, headers=ADMIN)
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued"
    assert job["num_nodes"] == 2 and job["gpus_per_node"] == 2
    assert job["checkpoint"] == {"interval_steps": 50, "keep_last": 3, "memory_tier": True}
    assert job["max_failures"] == 3
    assert job["progress"] == {"step": None, "loss": None, "updated_at": None, "total_steps": None,
                               "steps_per_s": None, "eta_s": None, "metrics": {}}
    assert job["current_attempt"] is None and job["allocation"] == []
    assert r.headers["location"] == f"/v1/jobs/{job['id']}"


def test_get_and_list_with_filter_and_pagination(cluster, schedule):
    ids = [cluster.post("/v1/jobs", json=job_body(name=f"j{i}", num_nodes=1), headers=ADMIN).json()["id"]
           for i in range(5)]
    assert schedule() == 2  # two 1x2 jobs fit on two 2-GPU nodes
    got = cluster.get(f"/v1/jobs/{ids[0]}", headers=ADMIN).json()
    assert got["state"] == "starting"
    assert len(got["allocation"]) == 1 and len(got["allocation"][0]["gpu_indices"]) == 2

    queued = cluster.get("/v1/jobs", params={"state": "queued"}, headers=ADMIN).json()
    assert {j["id"] for j in queued["items"]} == set(ids[2:])

    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = cluster.get("/v1/jobs", params=params, headers=ADMIN).json()
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))  # newest first, each exactly once


def test_idempotent_submit_returns_same_job(cluster):
    h = {**ADMIN, "Idempotency-Key": "abc-123"}
    first = cluster.post("/v1/jobs", json=TINY_GPT, headers=h)
    again = cluster.post("/v1/jobs", json=TINY_GPT, headers=h)
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert len(cluster.get("/v1/jobs", headers=ADMIN).json()["items"]) == 1
    other = cluster.post("/v1/jobs", json=job_body(name="other"), headers=h)
    assert other.status_code == 409
    assert other.headers["content-type"].startswith("application/problem+json")


def test_the_idempotency_hash_is_blind_to_fields_left_at_their_default():
    """A retry across an upgrade that added a job field (with a default) is the same request, and
    so is one that spells out a default: neither may be refused as a different body (409)."""
    from control_plane.schemas.jobs import JobSubmit
    from control_plane.services.runs.jobs import _request_hash

    class LaterJobSubmit(JobSubmit):
        a_field_added_later: int = 0

    sent = JobSubmit.model_validate(TINY_GPT)
    assert _request_hash(LaterJobSubmit.model_validate(TINY_GPT)) == _request_hash(sent)
    assert _request_hash(JobSubmit.model_validate({**TINY_GPT, "restartable": False})) == _request_hash(sent)
    assert _request_hash(JobSubmit.model_validate(job_body(name="other"))) != _request_hash(sent)


def test_cancel_queued_then_cancel_again_is_409(cluster):
    job = cluster.post("/v1/jobs", json=TINY_GPT, headers=ADMIN).json()
    r = cluster.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    again = cluster.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert again.status_code == 409
    body = again.json()
    assert body["status"] == 409 and "already ended" in body["detail"]
    kinds = [e["kind"] for e in cluster.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]]
    assert kinds == ["job.queued", "job.cancelled"]


def test_unknown_job_is_404_problem(cluster):
    r = cluster.get("/v1/jobs/00000000-0000-0000-0000-000000000000", headers=ADMIN)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["title"] and "does not exist" in r.json()["detail"]
    assert cluster.post("/v1/jobs/00000000-0000-0000-0000-000000000000/cancel", headers=ADMIN).status_code == 404


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"bogus": 1}, "bogus"),
        ({"num_nodes": -1}, "num_nodes"),
        ({"gpus_per_node": 0}, "gpus_per_node"),
        ({"entrypoint": ""}, "entrypoint"),
        ({"entrypoint": "   "}, "entrypoint"),
        ({"env": {"BIG": "x" * 40000}}, "env"),
        ({"env": {"RANK": "3"}}, "env"),
        # Finding 11: what would change torchrun, the loader or the platform's confinement.
        ({"env": {"PET_NPROC_PER_NODE": "8"}}, "env"),
        ({"env": {"TORCHELASTIC_MAX_RESTARTS": "3"}}, "env"),
        ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
        ({"env": {"LD_AUDIT": "/tmp/x.so"}}, "env"),
        ({"env": {"PATH": "/tmp/evil:/usr/bin"}}, "env"),
        ({"env": {"PYTHONHOME": "/tmp"}}, "env"),
        ({"env": {"HOME": "/root"}}, "env"),
        ({"env": {"TMPDIR": "/"}}, "env"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}}, "env"),
        ({"env": {"TRAINYARD_FENCING_TOKEN": "x"}}, "env"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"env": {"OK": "nul\u0000byte"}}, "env"),
        ({"max_failures": -2}, "max_failures"),
        ({"checkpoint": {"interval_steps": 0}}, "checkpoint.interval_steps"),
        ({"name": ""}, "name"),
        ({"gpu_kind": []}, "gpu_kind"),
        ({"gpu_kind": [""]}, "gpu_kind"),
        ({"gpu_kind": ["h100"] * 17}, "gpu_kind"),
    ],
)
def test_invalid_fields_are_422_problems(cluster, override, field):
    r = cluster.post("/v1/jobs", json=job_body(**override), headers=ADMIN)
    assert r.status_code == 422, r.text
    body = r.json()
    assert r.headers["content-type"].startswith("application/problem+json")
    assert body["status"] == 422
    assert any(e["field"].startswith(field) for e in body["errors"]), body
    assert cluster.get("/v1/jobs", headers=ADMIN).json()["items"] == []  # nothing was created


def test_env_names_say_why_they_are_refused_and_pythonpath_is_allowed(cluster):
    r = cluster.post("/v1/jobs", json=job_body(env={"PET_NNODES": "2"}), headers=ADMIN)
    assert r.status_code == 422 and "PET_NNODES" in r.text and "cannot be set by a job" in r.text
    ok = cluster.post("/v1/jobs", json=job_body(env={"PYTHONPATH": "/opt/lib", "NCCL_DEBUG": "INFO",
                                                     "LD_LIBRARY_PATH": "/opt/cuda"}), headers=ADMIN)
    assert ok.status_code == 201, ok.text


def test_the_servers_max_env_bytes_is_enforced(cluster, app):
    """Finding 11: settings.max_env_bytes was never read; below the schema's cap it now decides."""
    app.state.settings.max_env_bytes = 100
    env = {"A": "x" * 97}  # "A=" + 97 + NUL: 100 bytes
    assert cluster.post("/v1/jobs", json=job_body(env=env), headers=ADMIN).status_code == 201
    r = cluster.post("/v1/jobs", json=job_body(name="big", env={"A": "x" * 98}), headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json")
    assert "101 bytes" in r.json()["detail"] and "at most 100" in r.json()["detail"]


def test_job_larger_than_any_node_is_refused_with_reason(cluster):
    r = cluster.post("/v1/jobs", json=job_body(gpus_per_node=3), headers=ADMIN)
    assert r.status_code == 422
    assert "larger than any node" in r.json()["detail"]
    r = cluster.post("/v1/jobs", json=job_body(num_nodes=3), headers=ADMIN)
    assert r.status_code == 422
    assert "needs 3 nodes" in r.json()["detail"]


def test_auth_required(cluster):
    assert cluster.get("/v1/jobs").status_code == 401
    r = cluster.post("/v1/jobs", json=TINY_GPT, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.headers["content-type"].startswith("application/problem+json")
    assert cluster.post("/v1/agent/register", json={"name": "x", "address": "a", "gpus": []},
                        headers={"Authorization": "Bearer nope"}).status_code == 401


def test_health_and_openapi(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    spec = client.get("/openapi.json").json()
    submit = spec["paths"]["/v1/jobs"]["post"]
    schema_ref = submit["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    assert spec["components"]["schemas"][schema_ref]["examples"][0] == TINY_GPT
    for path in ["/v1/jobs/{job_id}/logs", "/v1/nodes", "/v1/cluster", "/v1/jobs/{job_id}/attempts"]:
        assert path in spec["paths"]
    assert client.get("/docs").status_code == 200


def test_cluster_and_nodes_views(cluster, schedule):
    cluster.post("/v1/jobs", json=job_body(num_nodes=1), headers=ADMIN)
    cluster.post("/v1/jobs", json=TINY_GPT, headers=ADMIN)
    schedule()
    view = cluster.get("/v1/cluster", headers=ADMIN).json()
    assert view["capacity"]["gpus_total"] == 4 and view["capacity"]["gpus_in_use"] == 2
    assert view["capacity"]["utilization"] == 0.5
    assert [q["gpus"] for q in view["queue"]] == [4]
    nodes = cluster.get("/v1/nodes", headers=ADMIN).json()
    leased = [g for n in nodes for g in n["gpus"] if g["job_id"]]
    assert len(leased) == 2 and all(n["state"] == "ready" for n in nodes)
