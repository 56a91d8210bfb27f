"""Jobs never wait silently and cancel always ends (issue 9, findings 14 and 16), through the HTTP
API on real PostgreSQL: the job view says what a waiting job waits for; a cancel ends ``cancelled``
even when a node of the attempt is lost (that node's leases stay held, shown in the node view,
until it returns); a job that ended shows ``releasing`` while its nodes still hold its GPUs."""

from __future__ import annotations

from control_plane.db import session_scope
from control_plane.services.cluster import nodes
from tests.control_plane.helpers import get_job, nodes_of, submit
from tests.factories import ADMIN, FakeAgentSession, job_body, reregister_node, workers_for


def _specs(agents, job_id):
    out = {}
    for agent in agents:
        for spec in agent.heartbeat()["assignments"]:
            if spec["job_id"] == job_id:
                out[agent.name] = spec
    return out


def _run(agents, specs):
    for agent in agents:
        if agent.name in specs:
            spec = specs[agent.name]
            r = agent.status(spec, "running", workers=workers_for(spec, "running"))
            assert r.status_code == 200, r.text


def _lose(app, clock, lost, healthy):
    clock.advance(5)
    for agent in healthy:
        agent.heartbeat(agent.alive)
    with session_scope(app.state.session_factory) as s:
        assert [n.name for n in nodes.mark_lost_nodes(s, timeout_s=2, not_before=clock.t)] == [lost.name]


def _held(client, name):
    [node] = [n for n in client.get("/v1/nodes", headers=ADMIN).json() if n["name"] == name]
    return [g["job_id"] for g in node["gpus"] if g["job_id"]]


def test_a_waiting_job_says_what_it_waits_for(client, schedule):
    a, b = FakeAgentSession(client, "gpu-a", 2), FakeAgentSession(client, "gpu-b", 2)
    job = submit(client, num_nodes=2, gpus_per_node=2, gpu_kind="virtual-cpu")
    assert client.post(f"/v1/nodes/{b.node_id}/cordon", headers=ADMIN).status_code == 200
    assert schedule() == 0
    why = get_job(client, job["id"])["waiting_for"]
    assert "needs 2 nodes with 2 GPUs of kind virtual-cpu, the cluster has 1 such nodes that take work" in why
    assert "gpu-b cordoned" in why
    # Both nodes now report another GPU kind: nothing could ever hold the job.
    tokens = {agent.name: reregister_node(client, agent.name, agent.token, 2, kind="h100")["node_token"]
              for agent in (a, b)}
    assert get_job(client, job["id"])["waiting_for"] == "no node with GPU kind virtual-cpu"
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)

    # Too few free GPUs, and a tenant at its quota.
    a, b = (FakeAgentSession(client, name, 2, credential=tokens[name]) for name in ("gpu-a", "gpu-b"))  # virtual-cpu
    assert client.post(f"/v1/nodes/{b.node_id}/uncordon", headers=ADMIN).status_code == 200
    assert client.put("/v1/tenants/vision", json={"weight": 1, "gpu_quota": 3}, headers=ADMIN).status_code == 200
    first = submit(client, num_nodes=1, gpus_per_node=2, tenant="vision")
    assert schedule() == 1
    _specs([a, b], first["id"])
    big = submit(client, num_nodes=2, gpus_per_node=2)
    capped = submit(client, num_nodes=1, gpus_per_node=2, tenant="vision")
    schedule()
    why = get_job(client, big["id"])["waiting_for"]
    assert "needs 2 nodes with 2 free GPUs, the cluster has 1 such nodes now" in why
    capped_view = get_job(client, capped["id"])
    assert capped_view["state"] == "queued", capped_view
    assert "quota: tenant vision uses 2 of its 3 GPUs and the job needs 2" in capped_view["waiting_for"]
    assert get_job(client, first["id"])["waiting_for"].endswith("to launch node rank 0")  # not reported yet

    # A job may accept several GPU kinds (issue 15): it runs on one, and the view says which.
    FakeAgentSession(client, "gpu-c", 2, kind="h100")
    r = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=2, gpu_kind=["a100", "l4"]), headers=ADMIN)
    assert r.status_code == 422 and "no nodes with GPUs of kind 'a100' or 'l4'" in r.json()["detail"]
    either = submit(client, num_nodes=1, gpus_per_node=2, gpu_kind=["h100", "a100", "h100"])
    assert either["gpu_kind"] == ["h100", "a100"] and either["allocated_gpu_kind"] is None
    schedule()
    view = get_job(client, either["id"])
    assert view["state"] == "starting" and view["allocated_gpu_kind"] == "h100" and nodes_of(view) == {"gpu-c"}


def test_cancel_ends_even_when_a_node_of_the_attempt_is_lost(clock, app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = submit(client, num_nodes=2, gpus_per_node=1)
    assert schedule() == 1
    specs = _specs(agents, job["id"])
    _run(agents, specs)
    assert get_job(client, job["id"])["state"] == "running"
    attempt_id = specs["node-1"]["attempt_id"]
    for agent in agents:
        agent.alive = [attempt_id]

    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
    agents[0].alive = []
    agents[0].heartbeat([])  # node-1 stopped its workers; node-2 goes silent
    view = get_job(client, job["id"])
    assert view["state"] == "cancelling" and view["waiting_for"] == "node node-2 to confirm its workers stopped"

    _lose(app, clock, agents[1], healthy=[agents[0]])
    view = get_job(client, job["id"])
    assert view["state"] == "cancelled", view
    assert "node-2 lost" in view["end_reason"]
    # Its lease stays held, visibly, on the lost node until it comes back.
    assert view["leases_held"] == 1 and view["releasing"] is True
    assert _held(client, "node-2") == [job["id"]]
    assert client.get("/v1/cluster", headers=ADMIN).json()["capacity"]["gpus_releasing"] == 1
    agents[1].heartbeat([])  # back, its workers gone
    view = get_job(client, job["id"])
    assert view["leases_held"] == 0 and view["releasing"] is False and _held(client, "node-2") == []
    [attempt] = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["state"] == "ended"


def test_cancel_of_a_recovering_job_whose_old_attempt_is_on_a_lost_node_ends(clock, app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = submit(client, num_nodes=2, gpus_per_node=1, max_failures=3)
    assert schedule() == 1
    specs = _specs(agents, job["id"])
    _run(agents, specs)
    agents[0].alive = []
    _lose(app, clock, agents[1], healthy=[agents[0]])
    assert get_job(client, job["id"])["state"] == "recovering"
    agents[0].heartbeat([])  # the healthy node stopped its part
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
    view = get_job(client, job["id"])
    assert view["state"] == "cancelled" and view["releasing"] is True and _held(client, "node-2") == [job["id"]]


def test_a_job_that_ended_shows_releasing_until_its_nodes_give_its_gpus_back(client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = submit(client, num_nodes=2, gpus_per_node=1)
    assert schedule() == 1
    specs = _specs(agents, job["id"])
    for agent in agents:
        spec = specs[agent.name]
        agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0))
    view = get_job(client, job["id"])
    assert view["state"] == "succeeded"
    assert view["leases_held"] == 2 and view["releasing"] is True  # the interval, shown
    agents[0].heartbeat([])
    assert get_job(client, job["id"])["leases_held"] == 1
    agents[1].heartbeat([])
    view = get_job(client, job["id"])
    assert view["leases_held"] == 0 and view["releasing"] is False
    assert client.get("/v1/cluster", headers=ADMIN).json()["capacity"]["gpus_releasing"] == 0


# --- issue 26: a recovering job says why and what for; nothing it shows is stale ---

def test_a_job_recovering_from_a_lost_node_says_why_and_its_pending_checkpoint_is_aborted(clock, app, client,
                                                                                          schedule):
    from control_plane.services.checkpoints import checkpoints
    from control_plane.services.checkpoints.checkpoints import checkpoint_prefix

    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = submit(client, num_nodes=2, gpus_per_node=1, max_failures=3)
    assert schedule() == 1
    specs = _specs(agents, job["id"])
    _run(agents, specs)
    # Rank 0's shard of step 20 arrived; rank 1's never will: node-2 is lost.
    spec = specs["node-1"]
    shard = {"rank": 0, "step": 20, "world_size": 2, "key": f"{checkpoint_prefix(job['id'], 20, 1)}/rank-00000.pt",
             "size_bytes": 4, "sha256": "0" * 64}
    r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agents[0].headers,
                    json={"fencing_token": spec["fencing_token"], "node_rank": 0, "shards": [shard]})
    assert r.status_code == 200, r.text
    agents[0].alive = [spec["attempt_id"]]
    _lose(app, clock, agents[1], healthy=[agents[0]])
    view = get_job(client, job["id"])
    assert view["state"] == "recovering"
    why = view["waiting_for"]
    assert why.startswith("a new attempt: attempt 1 failed (node_lost)"), why
    assert "node node-2 (lost) to return or be removed: it still holds attempt 1's GPUs" in why
    assert "needs 2 nodes with 1 GPUs, the cluster has 1 such nodes that take work (also node-2 lost)" in why

    checkpoints.maintenance(app.state.session_factory, None, pending_timeout_s=600.0)
    [ckpt] = client.get(f"/v1/jobs/{job['id']}/checkpoints", headers=ADMIN).json()["items"]
    assert ckpt["state"] == "aborted", ckpt
    events = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1000}, headers=ADMIN).json()["items"]
    assert any("attempt 1 failed before all shards arrived (node node-2 lost)" in e["message"] for e in events)


def test_a_reservation_whose_earliest_start_passed_says_what_it_still_waits_for():
    from datetime import UTC, datetime, timedelta
    from types import SimpleNamespace

    from control_plane.schemas.scheduling import ReservationOut
    from control_plane.services.read.views import _NodeCap, _reservation_reason

    t = datetime.now(UTC)
    res = ReservationOut(job_id="j", job_name="big", nodes=["node-1", "node-2"], earliest_start=t - timedelta(hours=1),
                         first_earliest_start=t - timedelta(hours=2), held_gpus=1, idle_gpu_seconds=0.0, since=t)
    caps = [_NodeCap("node-1", "ready", True, False, "h100", 2, 2),
            _NodeCap("node-2", "lost", True, False, "h100", 2, 0),
            _NodeCap("node-3", "ready", True, False, "h100", 2, 1)]
    said = _reservation_reason(SimpleNamespace(gpus_per_node=2), res, caps)  # type: ignore[arg-type]
    assert said == "reservation on nodes node-1, node-2: its estimated start has passed; waiting for node-2 lost"
    later = res.model_copy(update={"earliest_start": t + timedelta(hours=1)})
    assert _reservation_reason(SimpleNamespace(gpus_per_node=2), later, caps).endswith(  # type: ignore[arg-type]
        f"earliest start {later.earliest_start.isoformat()}")  # type: ignore[union-attr]
