"""Admin API against real Postgres: tenants (weights, quotas) and node cordon/drain/uncordon."""

from __future__ import annotations

from tests.control_plane.access import make_principal
from tests.control_plane.helpers import finish, get_job, nodes_of, submit
from tests.factories import ADMIN, FakeAgentSession, job_body, register_node


def test_tenants_api_and_submit_refuses_a_job_larger_than_the_quota(client):
    register_node(client, "node-1", 4)
    r = client.put("/v1/tenants/vision", json={"weight": 2, "gpu_quota": 3}, headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json() == {"name": "vision", "weight": 2.0, "gpu_quota": 3, "max_priority": 0, "configured": True,
                        "gpus_in_use": 0,
                        "weighted_share": 0.0, "jobs_waiting": 0, "jobs_running": 0}
    too_big = client.post("/v1/jobs", json=job_body(tenant="vision", num_nodes=1, gpus_per_node=4), headers=ADMIN)
    assert too_big.status_code == 422 and "quota of 3" in too_big.json()["detail"]
    submit(client, tenant="nlp", num_nodes=1, gpus_per_node=4)  # no row: weight 1, no quota
    listed = {t["name"]: t for t in client.get("/v1/tenants", headers=ADMIN).json()}
    assert listed["nlp"]["configured"] is False and listed["nlp"]["jobs_waiting"] == 1
    assert listed["vision"]["jobs_waiting"] == 0
    # A team that has people but no job yet is listed too (a fresh cluster's `trainyard tenants`
    # printed only a header), as is a team whose jobs all ended.
    make_principal(client, "ana", "member", "speech")
    finish_all = client.post(f"/v1/jobs/{submit(client, tenant='audio', num_nodes=1)['id']}/cancel", headers=ADMIN)
    assert finish_all.status_code == 200
    listed = {t["name"]: t for t in client.get("/v1/tenants", headers=ADMIN).json()}
    assert listed["speech"]["configured"] is False and listed["speech"]["jobs_waiting"] == 0
    assert "audio" in listed and listed["audio"]["jobs_waiting"] == listed["audio"]["jobs_running"] == 0
    for bad in ({"weight": 0}, {"gpu_quota": -1}, {"weight": 1, "extra": 1}):
        assert client.put("/v1/tenants/vision", json=bad, headers=ADMIN).status_code == 422
    assert client.put("/v1/tenants/Not_Valid", json={}, headers=ADMIN).status_code == 422
    assert client.put("/v1/tenants/vision", json={}).status_code == 401


def test_cordon_drain_uncordon(client, schedule):
    a, b = FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")
    running = submit(client, num_nodes=1, gpus_per_node=2)
    assert schedule() == 1
    on = nodes_of(get_job(client, running["id"]))
    busy, idle = (a, b) if on == {"node-1"} else (b, a)

    drained = client.post(f"/v1/nodes/{busy.node_id}/drain", headers=ADMIN)
    assert drained.status_code == 200 and drained.json()["scheduling"] == "draining"
    cordoned = client.post(f"/v1/nodes/{idle.node_id}/cordon", headers=ADMIN).json()
    assert cordoned["scheduling"] == "cordoned" and cordoned["schedulable"] is False
    waiting = submit(client, num_nodes=1, gpus_per_node=1)
    assert schedule() == 0 and get_job(client, waiting["id"])["state"] == "queued"
    assert client.get("/v1/cluster", headers=ADMIN).json()["capacity"]["gpus_allocatable"] == 0

    # Draining stops nothing: the job runs to its end, then the node shows as drained.
    assert get_job(client, running["id"])["state"] == "starting"
    finish([busy], running["id"])
    assert get_job(client, running["id"])["state"] == "succeeded"
    view = client.get(f"/v1/nodes/{busy.node_id}", headers=ADMIN).json()
    assert view["scheduling"] == "drained" and all(g["job_id"] is None for g in view["gpus"])
    assert schedule() == 0

    assert client.post(f"/v1/nodes/{idle.node_id}/uncordon", headers=ADMIN).json()["scheduling"] == "schedulable"
    assert schedule() == 1 and nodes_of(get_job(client, waiting["id"])) == {idle.name}
    kinds = [e["kind"] for e in client.get(f"/v1/nodes/{busy.node_id}", headers=ADMIN).json()["gpus"]]
    assert kinds  # the node view still lists its GPUs
    assert client.post("/v1/nodes/00000000-0000-0000-0000-000000000000/drain", headers=ADMIN).status_code == 404
