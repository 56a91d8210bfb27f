"""Fair scheduling through the API against real Postgres: quotas and weighted shares, operator labels
and topology, reservations with backfill and their idle cost, the recovery hold and reserve."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.clock import now
from control_plane.db import session_scope
from control_plane.services.cluster import reservations
from control_plane.settings import Settings
from tests.control_plane.helpers import finish, get_job, nodes_of, submit
from tests.factories import ADMIN, FakeAgentSession, register_node, reregister_node, workers_for

# -- tenants ------------------------------------------------------------------------------------


def test_quota_makes_a_tenant_wait_while_others_run(client, schedule):
    register_node(client, "node-1", 2)
    register_node(client, "node-2", 2)
    client.put("/v1/tenants/vision", json={"gpu_quota": 2}, headers=ADMIN)
    a1 = submit(client, tenant="vision", num_nodes=1, gpus_per_node=2)
    a2 = submit(client, tenant="vision", num_nodes=1, gpus_per_node=2)
    b1 = submit(client, tenant="nlp", num_nodes=1, gpus_per_node=2)
    assert schedule() == 2
    assert [get_job(client, j["id"])["state"] for j in (a1, a2, b1)] == ["starting", "queued", "starting"]
    listed = {t["name"]: t for t in client.get("/v1/tenants", headers=ADMIN).json()}
    assert listed["vision"]["gpus_in_use"] == 2 and listed["vision"]["jobs_waiting"] == 1
    # a2 is blocked by the quota, not by capacity: it holds no reservation.
    assert get_job(client, a2["id"])["reservation"] is None


def test_lower_weighted_share_is_served_first(client, schedule):
    register_node(client, "node-1", 2)
    client.put("/v1/tenants/heavy", json={"weight": 4}, headers=ADMIN)
    first = submit(client, tenant="light", num_nodes=1, gpus_per_node=1)
    assert schedule() == 1  # light now uses 1 GPU (share 1); heavy uses 0
    old = submit(client, tenant="light", num_nodes=1, gpus_per_node=1)
    new = submit(client, tenant="heavy", num_nodes=1, gpus_per_node=1)
    queue = client.get("/v1/cluster", headers=ADMIN).json()["queue"]
    assert [q["id"] for q in queue] == [new["id"], old["id"]]
    assert schedule() == 1
    assert get_job(client, new["id"])["state"] == "starting" and get_job(client, old["id"])["state"] == "queued"
    assert get_job(client, first["id"])["state"] == "starting"


# -- node labels and topology ------------------------------------------------------------------


def test_operator_labels_win_and_keep_a_gang_in_one_rack(client, schedule):
    regs = {name: register_node(client, name, 2, labels={"rack": "r1"}) for name in ("node-1", "node-2", "node-3")}
    ids = {name: reg["node_id"] for name, reg in regs.items()}
    r = client.put(f"/v1/nodes/{ids['node-2']}/labels", json={"labels": {"rack": "r2"}}, headers=ADMIN)
    assert r.status_code == 200 and r.json()["labels"] == {"rack": "r2"} and r.json()["label_overrides"] == {
        "rack": "r2"}
    register_node(client, "node-4", 2, labels={"rack": "r2"})
    # Re-registration (agent restart) keeps the operator's label.
    reregister_node(client, "node-2", regs["node-2"]["node_token"], 2, labels={"rack": "r1"})
    assert client.get(f"/v1/nodes/{ids['node-2']}", headers=ADMIN).json()["labels"] == {"rack": "r2"}
    one = submit(client, num_nodes=1, gpus_per_node=2)
    assert schedule() == 1
    first = nodes_of(get_job(client, one["id"]))
    gang = submit(client, num_nodes=2, gpus_per_node=2)
    assert schedule() == 1
    racks = {"node-1": "r1", "node-3": "r1", "node-2": "r2", "node-4": "r2"}
    chosen = nodes_of(get_job(client, gang["id"]))
    assert len({racks[n] for n in chosen}) == 1 and not (chosen & first)
    bad = client.put(f"/v1/nodes/{ids['node-1']}/labels", json={"labels": {"bad key": "x"}}, headers=ADMIN)
    assert bad.status_code == 422


# -- reservations, backfill, idle cost ------------------------------------------------------------


def test_reservation_holds_nodes_backfill_runs_and_the_cost_is_shown(client, schedule, clock):
    a, b = FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")
    small = submit(client, name="small", num_nodes=1, gpus_per_node=1, time_limit_s=100)
    assert schedule() == 1
    big = submit(client, name="big", num_nodes=2, gpus_per_node=2)
    assert schedule() == 0
    view = get_job(client, big["id"])
    res = view["reservation"]
    assert view["state"] == "queued" and set(res["nodes"]) == {"node-1", "node-2"}
    assert datetime.fromisoformat(res["earliest_start"]) == clock.t + timedelta(seconds=100)  # small's limit
    assert res["held_gpus"] == 3  # one free GPU beside small, two on the other node

    # A job without a time limit waits; one that ends before the earliest start backfills.
    forever = submit(client, name="forever", num_nodes=1, gpus_per_node=1)
    clock.advance(10)
    assert schedule() == 0
    short = submit(client, name="short", num_nodes=1, gpus_per_node=2, time_limit_s=60)
    clock.advance(10)
    assert schedule() == 1 and get_job(client, short["id"])["state"] == "starting"
    assert get_job(client, forever["id"])["state"] == "queued"

    cluster = client.get("/v1/cluster", headers=ADMIN).json()["scheduling"]
    (live,) = cluster["reservations"]
    assert live["job_name"] == "big" and live["held_gpus"] == 1
    assert live["idle_gpu_seconds"] == pytest.approx(3 * 20)  # 3 GPUs held for 20 s, then 1
    clock.advance(5)
    assert client.get("/v1/cluster", headers=ADMIN).json()["scheduling"]["reservation_idle_gpu_seconds"] == \
        pytest.approx(3 * 20 + 1 * 5)

    # small and short end; big starts on its reserved nodes; forever still waits behind it.
    finish([a, b], small["id"])
    finish([a, b], short["id"])
    assert schedule() == 1
    started = get_job(client, big["id"])
    assert started["state"] == "starting" and nodes_of(started) == {"node-1", "node-2"}
    assert started["reservation"] is None
    after = client.get("/v1/cluster", headers=ADMIN).json()["scheduling"]
    assert after["reservations_started"] == 1 and after["reservations_started_on_time"] == 1
    assert after["reservations_started_estimated"] == 1
    assert after["reservation_idle_gpu_seconds"] == pytest.approx(3 * 20 + 1 * 5)
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{big['id']}/events", headers=ADMIN).json()["items"]]
    assert kinds.index("job.reserved") < kinds.index("job.starting")


def test_a_recovering_job_keeps_its_healthy_node(client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}") for i in (1, 2, 3)]
    rec = submit(client, name="rec", num_nodes=2, gpus_per_node=2, max_failures=2)
    assert schedule() == 1
    on = nodes_of(get_job(client, rec["id"]))
    (third,) = [a for a in agents if a.name not in on]
    filler = submit(client, name="filler", num_nodes=1, gpus_per_node=2)
    assert schedule() == 1 and nodes_of(get_job(client, filler["id"])) == {third.name}
    # rec's node rank 1 fails; the operator cordons that node.
    specs = {a.name: a.heartbeat()["assignments"] for a in agents}
    failing = next(a for a in agents if any(s["job_id"] == rec["id"] and s["node_rank"] == 1 for s in specs[a.name]))
    healthy = next(a for a in agents if a.name in on and a is not failing)
    spec = next(s for s in specs[failing.name] if s["job_id"] == rec["id"])
    failing.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
    client.post(f"/v1/nodes/{failing.node_id}/cordon", headers=ADMIN)
    for a in (failing, healthy):
        a.heartbeat([])
    assert get_job(client, rec["id"])["state"] == "recovering"
    short = submit(client, name="short", num_nodes=1, gpus_per_node=1, time_limit_s=5)
    assert schedule() == 0
    view = get_job(client, rec["id"])
    assert view["state"] == "recovering" and healthy.name in view["reservation"]["nodes"]
    assert get_job(client, short["id"])["state"] == "queued"  # not even backfill on the healthy node
    # Once the filler ends, rec resumes on its healthy node plus the free one.
    finish(agents, filler["id"])
    assert schedule() == 1
    assert nodes_of(get_job(client, rec["id"])) == {healthy.name, third.name}


@pytest.fixture
def reserve_client(fresh_database_url: str) -> Iterator[tuple[TestClient, FastAPI]]:
    settings = Settings(database_url=fresh_database_url, admin_token="test-admin-token",
                        join_token="test-join-token", run_loops=False, log_json=False, startup_grace_s=0,
                        recovery_reserve_nodes={"virtual-cpu": 1})
    app = create_app(settings)
    with TestClient(app) as c:
        yield c, app


def test_recovery_reserve_is_kept_for_recoveries_and_its_cost_shown(reserve_client, clock):
    client, app = reserve_client
    schedule = app.state.loops.schedule_once
    agents = [FakeAgentSession(client, f"node-{i}") for i in (1, 2, 3)]
    rec = submit(client, name="rec", num_nodes=1, gpus_per_node=2, max_failures=2)
    clock.advance(1)
    submit(client, name="other", num_nodes=1, gpus_per_node=2)
    clock.advance(1)
    waits = submit(client, name="waits", num_nodes=1, gpus_per_node=2)
    assert schedule() == 2
    assert get_job(client, waits["id"])["state"] == "queued"  # the third node is the reserve
    (reserve,) = client.get("/v1/cluster", headers=ADMIN).json()["scheduling"]["recovery_reserve"]
    assert reserve["gpu_kind"] == "virtual-cpu" and reserve["idle_gpus"] == 2 and len(reserve["nodes"]) == 1
    clock.advance(30)
    # rec's node fails and is cordoned: rec recovers on the reserve node.
    holder = next(a for a in agents if a.name in nodes_of(get_job(client, rec["id"])))
    spec = holder.heartbeat()["assignments"][0]
    holder.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
    client.post(f"/v1/nodes/{holder.node_id}/cordon", headers=ADMIN)
    holder.heartbeat([])
    assert schedule() == 1
    resumed = get_job(client, rec["id"])
    assert resumed["state"] == "starting" and nodes_of(resumed) == set(reserve["nodes"])
    assert get_job(client, waits["id"])["state"] == "queued"
    (after,) = client.get("/v1/cluster", headers=ADMIN).json()["scheduling"]["recovery_reserve"]
    assert after["recoveries_served"] == 1 and after["idle_gpu_seconds"] == pytest.approx(2 * 30)


def test_pending_cache_reads_what_a_fresh_read_does(client, app, schedule):
    from control_plane.scheduler.allocate import PendingCache, pending_jobs

    register_node(client, "node-1", 2)
    jobs = [submit(client, name=f"j{i}", num_nodes=1, gpus_per_node=2, priority=i % 2) for i in range(4)]
    cache = PendingCache()
    factory = app.state.session_factory

    def both() -> tuple[list[tuple], list[tuple]]:
        with factory() as s:
            return [tuple(r) for r in pending_jobs(s, cache)], [tuple(r) for r in pending_jobs(s)]

    cached, fresh = both()
    assert cached == fresh and len(cached) == 4 and set(cache.rows) == {j["id"] for j in jobs}
    client.post(f"/v1/jobs/{jobs[1]['id']}/cancel", headers=ADMIN)
    assert schedule() == 1  # j3 (priority 1) starts
    late = submit(client, name="late", num_nodes=1, gpus_per_node=1)
    cached, fresh = both()
    assert cached == fresh and {r[0] for r in cached} == {jobs[0]["id"], jobs[2]["id"], late["id"]}
    assert set(cache.rows) == {r[0] for r in cached}  # those that left are forgotten


def test_a_gang_behind_a_stream_of_small_jobs_holds_its_reservation_until_it_starts(client, schedule, clock):
    """Finding 15, through the real pass on Postgres: 2 nodes x 2 GPUs, 1-GPU jobs (8 s, limit 40 s)
    kept 4 deep in the queue, a 2x2 gang (limit 60 s) behind the first 6. The 1-GPU reservations
    before it used to hold both nodes whole, so the gang reserved nothing and the 1-GPU jobs after
    it started instead, for ever. Every pass sees the attempts that stop (their leases still held)
    and those that start."""
    agents = [FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")]
    smalls: list[str] = []

    def small() -> None:
        clock.advance(0.01)
        smalls.append(submit(client, name=f"s{len(smalls)}", num_nodes=1, gpus_per_node=1, time_limit_s=40)["id"])

    for _ in range(6):
        small()
    clock.advance(0.01)
    big = submit(client, name="big", num_nodes=2, gpus_per_node=2, time_limit_s=60)["id"]
    behind = len(smalls)  # smalls[behind:] came after the gang
    t0 = clock.t
    started: set[str] = set()

    def one_pass() -> dict:
        while sum(1 for j in smalls if j not in started) < 4:
            small()
        schedule()
        view = get_job(client, big)
        if view["state"] != "queued":
            return view
        res = view["reservation"]
        assert res is not None, f"the gang holds no reservation at +{(clock.t - t0).total_seconds()} s"
        start = datetime.fromisoformat(res["earliest_start"])
        for i, j in enumerate(smalls):
            if j not in started and get_job(client, j)["state"] != "queued":
                started.add(j)
                # A job that came after the gang starts only if it ends before the gang's start.
                assert i < behind or clock.t + timedelta(seconds=40) <= start, (f"s{i}", clock.t, start)
        return view

    view = one_pass()
    for _ in range(10):
        if view["state"] != "queued":
            break
        clock.advance(8)
        running = [j for j in started if get_job(client, j)["state"] in ("starting", "running")]
        for agent in agents:
            for spec in agent.heartbeat()["assignments"]:
                if spec["job_id"] in running:
                    agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0))
        view = one_pass()  # the attempts are stopping: their GPUs are not given back yet
        if view["state"] != "queued":
            break
        for agent in agents:
            agent.heartbeat([])
        view = one_pass()
    assert view["state"] == "starting", view
    assert clock.t - t0 <= timedelta(seconds=40)


def test_reservations_made_in_one_pass_are_kept_in_the_order_made(client, app, clock):
    """A pass makes many reservations at one ``created_at``; the next pass gets them back in the
    order made (issue 15: by random ids before, so a pass depended on them)."""
    node = register_node(client, "node-1", 2)
    jobs = [uuid.UUID(submit(client, num_nodes=1, gpus_per_node=2)["id"]) for _ in range(6)]
    made = sorted(jobs, reverse=True)  # ids the other way round: an order by id reads them reversed
    node_id = uuid.UUID(node["node_id"])
    with session_scope(app.state.session_factory) as s:
        reservations.record(s, at=now(), holds=[reservations.JobHold(j, [node_id], None, 2) for j in made],
                            reserve=[], started=set(), waiting=[str(j) for j in jobs])
    with session_scope(app.state.session_factory) as s:
        assert list(reservations.previous(s)) == [str(j) for j in made]
