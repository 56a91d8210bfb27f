"""Recovery decisions over the agent protocol, against real PostgreSQL: lost nodes, blame, avoiding a
node that failed a job twice, operator removal, the recovery facts of the job view."""

from __future__ import annotations

import time
import uuid

import pytest

from control_plane import clock
from control_plane.db import session_scope
from control_plane.models import Node
from control_plane.scheduler.loops import Loops
from control_plane.services.cluster import nodes
from control_plane.services.read import metrics
from control_plane.services.runs.recovery_budget import PHASES
from tests.control_plane.test_ui_pages import login_csrf
from tests.factories import ADMIN, ADMIN_TOKEN, FakeAgentSession, job_body, workers_for
from trainyard.cli import job_view
from trainyard.protocol.agent import HeartbeatRequest


@pytest.fixture
def three_nodes(client):
    return [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]


def _job(client, job_id):
    return client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def _attempts(client, job_id):
    return client.get(f"/v1/jobs/{job_id}/attempts", headers=ADMIN).json()["items"]


def _assignments(agents) -> dict[str, dict]:
    out = {}
    for agent in agents:
        for spec in agent.heartbeat()["assignments"]:
            out[agent.name] = spec
    return out


def _lose(app, agents, lost, *, healthy):
    """Let ``lost`` miss its heartbeats while ``healthy`` keep theirs, then run the liveness check."""
    time.sleep(0.6)
    for agent in healthy:
        agent.heartbeat()
    with session_scope(app.state.session_factory) as s:
        names = [n.name for n in nodes.mark_lost_nodes(s, timeout_s=0.5, not_before=clock.now())]
    assert names == [lost.name]


def _fail(agent, spec, code=1):
    r = agent.status(spec, "exited", exit_code=code, workers=workers_for(spec, "exited", code))
    assert r.status_code == 200, r.text


def test_lost_node_takes_the_blame_and_keeps_its_gpus_until_removed(app, client, schedule, three_nodes):
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1), headers=ADMIN).json()
    assert schedule() == 1
    specs = _assignments(three_nodes)
    (dead, dead_spec), (alive, alive_spec) = [(a, specs[a.name]) for a in three_nodes if a.name in specs]
    spare = next(a for a in three_nodes if a.name not in specs)
    # The surviving worker notices its peer vanish and exits first.
    _fail(alive, alive_spec)
    alive.heartbeat([])
    assert _attempts(client, job["id"])[0]["failed_node"] == alive.name
    _lose(app, three_nodes, dead, healthy=[alive, spare])
    first = _attempts(client, job["id"])[0]
    assert first["failed_node"] == dead.name and first["end_reason"].startswith(f"node {dead.name} lost")

    assert schedule() == 1
    second = _assignments([alive, spare])
    assert set(second) == {alive.name, spare.name}  # the healthy node kept, the dead one replaced
    held = [g for n in client.get("/v1/nodes", headers=ADMIN).json() if n["name"] == dead.name for g in n["gpus"]]
    assert [g["attempt_id"] for g in held] == [dead_spec["attempt_id"]]

    # A node that still runs an attempt cannot be removed; a lost one can, which frees its GPU.
    r = client.delete(f"/v1/nodes/{alive.node_id}", headers=ADMIN)
    assert r.status_code == 409 and "cancel those jobs" in r.json()["detail"]
    r = client.delete(f"/v1/nodes/{dead.node_id}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "removed"
    assert dead.node_id not in {n["id"] for n in client.get("/v1/nodes", headers=ADMIN).json()}
    assert _attempts(client, job["id"])[0]["state"] == "ended"
    # Its old credential is dead; registering again brings it back empty.
    r = client.post("/v1/agent/heartbeat", json={"agent_instance": "x", "seq": 99, "attempts": []},
                    headers=dead.headers)
    assert r.status_code == 401
    back = FakeAgentSession(client, dead.name, 1)
    assert back.node_id == dead.node_id and back.heartbeat([dead_spec["attempt_id"]])["assignments"] == []
    assert {n["name"]: n["state"] for n in client.get("/v1/nodes", headers=ADMIN).json()}[dead.name] == "ready"


def test_a_node_that_failed_a_job_twice_is_avoided(client, schedule, three_nodes):
    client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, max_failures=5), headers=ADMIN)
    by_name = {a.name: a for a in three_nodes}
    used = []
    for _ in range(3):
        assert schedule() == 1
        [(name, spec)] = _assignments(three_nodes).items()
        used.append(name)
        if len(used) < 3:
            # Fail it twice on the node it gets: the recovery goes back to its last attempt's node
            # as long as it may (whichever node that is: placement never depends on names). A
            # worker killed by a signal: a node's kind of failure (an exception would not count).
            _fail(by_name[name], spec, code=-9)
            by_name[name].heartbeat([])
    assert used[0] == used[1] and used[2] != used[0]


def test_a_job_that_only_fits_on_a_twice_failed_node_fails(client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1, max_failures=5),
                      headers=ADMIN).json()
    for _ in range(2):
        assert schedule() == 1
        specs = _assignments(agents)
        _fail(agents[0], specs["node-1"], code=-9)  # a node's kind of failure (NODE_FAULT_KINDS)
        for a in agents:
            a.heartbeat([])
    assert schedule() == 0
    view = _job(client, job["id"])
    assert view["state"] == "failed" and "without node-1, which failed it twice" in view["end_reason"]


def test_job_view_tells_how_each_recovery_went(client, schedule, three_nodes):
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
    assert schedule() == 1
    [(name, spec)] = _assignments(three_nodes).items()
    agent = next(a for a in three_nodes if a.name == name)
    p = {"step": 57, "loss": 1.0, "at": "2026-12-02T10:00:00Z"}
    agent.status(spec, "running", workers=workers_for(spec, "running"), progress=p)
    _fail(agent, spec, code=-9)
    agent.heartbeat([])
    assert schedule() == 1
    [(name2, spec2)] = _assignments(three_nodes).items()
    agent2 = next(a for a in three_nodes if a.name == name2)
    client.post(f"/v1/agent/attempts/{spec2['attempt_id']}/events", headers=agent2.headers, json={
        "fencing_token": spec2["fencing_token"], "node_rank": 0,
        "events": [{"rank": 0, "kind": "checkpoint.restored", "message": "restored", "data": {"step": 40}}]})
    agent2.status(spec2, "running", workers=workers_for(spec2, "running"),
                  progress={"step": 41, "loss": 1.0, "at": "2026-12-02T10:01:00Z"})
    first, second = _attempts(client, job["id"])
    assert first["recovery"] is None and first["progress_step"] == 57 and first["failed_node"] == name
    rec = second["recovery"]
    assert rec["after_attempt"] == 1 and rec["steps_lost"] == 17 and second["restored_from_step"] == 40
    for phase in ("detection_s", "decision_s", "process_start_s", "restore_s", "to_first_step_s"):
        assert rec[phase] is not None and rec[phase] >= 0, phase
    # This agent reported neither when it received the part nor the ranks' rendezvous: those phases
    # are null and their time is in the next ones, which still add up to the whole.
    assert rec["wake_up_s"] is None and rec["rendezvous_s"] is None
    assert sum(rec[f"{p}_s"] or 0 for p in PHASES) == pytest.approx(rec["to_first_step_s"], abs=1e-6)


def _at(t) -> str:
    return t.isoformat().replace("+00:00", "Z")


def test_a_recovery_splits_into_its_phases_on_the_control_planes_clock_and_names_the_one_over_budget(
        client, schedule, three_nodes, clock):
    budget = {"rendezvous": 1.0}
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1,
                                                 watchdog={"recovery_budget_s": budget}), headers=ADMIN).json()
    assert schedule() == 1
    [(name, spec)] = _assignments(three_nodes).items()
    agent = next(a for a in three_nodes if a.name == name)
    agent.status(spec, "running", workers=workers_for(spec, "running"),
                 progress={"step": 30, "loss": 1.0, "at": _at(clock.t)})
    failure = clock.t
    clock.advance(0.4)  # the exit reaches the control plane 0.4 s after it happened
    workers = [{**w, "ended_at": _at(failure)} for w in workers_for(spec, "exited", -9)]
    assert agent.status(spec, "exited", exit_code=-9, workers=workers).status_code == 200
    clock.advance(0.6)
    agent.heartbeat([])
    assert schedule() == 1  # decision: 0.6 s
    [(name2, spec2)] = _assignments(three_nodes).items()
    agent2 = next(a for a in three_nodes if a.name == name2)
    before = metrics.PROCESS.get_sample_value("trainyard_recovery_phase_seconds_count", {"phase": "wake_up"}) or 0
    # The agent's wall clock is four years ahead: the worker times it sends are nonsense to us, and
    # nothing of the split may depend on them. Its ages are by its monotonic clock.
    skewed = [{**w, "started_at": "2030-12-05T03:00:00Z"} for w in workers_for(spec2, "running")]
    clock.advance(0.5)
    assert agent2.status(spec2, "launching", received_s_ago=0.2).status_code == 200  # received at +1.3
    clock.advance(1.0)
    assert agent2.status(spec2, "running", workers=skewed, received_s_ago=1.2).status_code == 200  # running +2.5
    clock.advance(2.0)
    r = agent2.status(spec2, "running", workers=skewed, received_s_ago=3.2, initialized_s_ago=0.5)  # init at +4.0
    assert r.status_code == 200, r.text
    clock.advance(0.7)
    r = agent2.status(spec2, "running", workers=skewed, received_s_ago=3.9, initialized_s_ago=1.2,
                      progress={"step": 21, "loss": 1.0, "at": "2030-12-05T03:00:05Z"})  # first step at +5.2
    assert r.status_code == 200, r.text

    rec = _attempts(client, job["id"])[1]["recovery"]
    assert {p: rec[f"{p}_s"] for p in PHASES} == {
        "detection": 0.4, "decision": 0.6, "wake_up": 0.3, "process_start": 1.2, "rendezvous": 1.5, "restore": 1.2}
    assert rec["to_first_step_s"] == 5.2
    assert rec["budget_s"]["rendezvous"] == 1.0 and rec["budget_s"]["detection"] == 15.0  # the job's, the cluster's
    assert rec["over_budget"] == [{"phase": "rendezvous", "seconds": 1.5, "budget_s": 1.0}]
    over = [e for e in client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]
            if e["kind"] == "recovery.over_budget"]
    assert len(over) == 1 and "rendezvous took 1.500s (budget 1s)" in over[0]["message"], over
    assert over[0]["data"]["phases"] == ["rendezvous"] and over[0]["data"]["total_s"] == 5.2
    after = metrics.PROCESS.get_sample_value("trainyard_recovery_phase_seconds_count", {"phase": "wake_up"})
    assert after == before + 1
    # A later report changes nothing: each instant is taken once, the event written once.
    agent2.status(spec2, "running", workers=skewed, received_s_ago=9.9, initialized_s_ago=9.9,
                  progress={"step": 22, "loss": 1.0, "at": "2030-12-05T03:00:06Z"})
    assert _attempts(client, job["id"])[1]["recovery"]["wake_up_s"] == 0.3
    events = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]
    assert sum(e["kind"] == "recovery.over_budget" for e in events) == 1

    # The CLI's describe and the dashboard's timeline show the same phases, the one over budget marked.
    line = job_view._recovery_line(rec).plain
    assert line.index("detection 0.40s") < line.index("wake up 0.30s") < line.index("restore 1.20s")
    assert "rendezvous 1.50s (budget 1s)" in line and "= 5.20s" in line
    r = client.post("/ui/login", data={"token": ADMIN_TOKEN, "next": "/ui", "csrf": login_csrf(client)},
                    follow_redirects=False)
    assert r.status_code == 303
    page = client.get(f"/ui/jobs/{job['id']}/live").text
    assert "process start 1.2" in page and 'title="over its budget of 1.0s">rendezvous 1.5' in page, page


@pytest.mark.parametrize("field, value", [("received_s_ago", -1), ("initialized_s_ago", "soon"),
                                          ("received_s_ago", 1e12)])
def test_a_bad_age_in_a_status_report_is_a_422(client, schedule, three_nodes, field, value):
    client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN)
    assert schedule() == 1
    [(name, spec)] = _assignments(three_nodes).items()
    agent = next(a for a in three_nodes if a.name == name)
    r = agent.status(spec, "launching", **{field: value})
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text


@pytest.mark.parametrize("budget", [{"wake_up": 0}, {"restore": -1}, {"nope": 1.0}, {"detection": "1"}])
def test_a_bad_recovery_budget_is_a_422(client, budget):
    r = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, watchdog={"recovery_budget_s": budget}),
                    headers=ADMIN)
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text


def test_the_step_in_progress_is_lost_work_even_when_its_report_arrives_after_the_exit(client, schedule,
                                                                                       three_nodes):
    # A worker reported step 20 at its node's 10:00:00 and was killed at 10:00:02 (its node's clock),
    # but its agent relayed the step only with the exit, now: the 2 s since the step are lost work.
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
    assert schedule() == 1
    [(name, spec)] = _assignments(three_nodes).items()
    agent = next(a for a in three_nodes if a.name == name)
    workers = [{**w, "ended_at": "2026-12-02T10:00:02Z"} for w in workers_for(spec, "exited", -9)]
    r = agent.status(spec, "exited", exit_code=-9, workers=workers,
                     progress={"step": 20, "loss": 1.0, "at": "2026-12-02T10:00:00Z"})
    assert r.status_code == 200, r.text
    agent.heartbeat([])
    g = _job(client, job["id"])["goodput"]
    assert g["lost_work_gpu_s"] == pytest.approx(2.0, abs=0.01)


def test_after_a_database_outage_nobody_is_declared_lost_at_once(settings):
    class Broken:
        def __call__(self):
            raise ConnectionError("database unreachable")

    loops = Loops(Broken(), settings.model_copy(update={"startup_grace_s": 30}))  # type: ignore[arg-type]
    loops._not_before = clock.now()
    with pytest.raises(ConnectionError):
        loops.monitor_once()
    assert (loops._not_before - clock.now()).total_seconds() > 25


def test_recovery_replaces_gpus_with_gpus_of_the_same_kind(client, schedule):
    first = FakeAgentSession(client, "a-1", 1, kind="h100")
    client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN)  # any kind
    assert schedule() == 1
    [(name, spec)] = _assignments([first]).items()
    others = [FakeAgentSession(client, "b-1", 1, kind="a100"), FakeAgentSession(client, "c-1", 1, kind="h100")]
    _fail(first, spec)
    # a-1 still holds its GPU (no heartbeat has confirmed its processes gone): the free GPUs are
    # b-1's (another kind, and first by name) and c-1's (the same kind as the failed attempt's).
    assert schedule() == 1
    assert list(_assignments(others)) == ["c-1"]

def test_a_released_gang_is_ended_by_its_releases_and_a_cancel_finished_by_the_monitor(app, client, schedule):
    """The releases end the gang in their own transactions (issue 31); only a cancelling job's
    ``cancelled``, which takes the job lock a release does not take, follows after their commit
    (attempts.finish_released). A control plane that dies in between leaves the job cancelling
    with its attempt ended: the monitor loop's sweep finishes it."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1, max_failures=1), headers=ADMIN).json()
    assert schedule() == 1
    _assignments(agents)
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).json()["state"] == "cancelling"
    with session_scope(app.state.session_factory) as session:
        for agent in agents:  # both confirm their processes gone; nothing runs after the commits
            nodes.heartbeat(session, session.get(Node, uuid.UUID(agent.node_id)),
                            HeartbeatRequest(agent_instance="crash", seq=1000, attempts=[]))
    [attempt] = _attempts(client, job["id"])
    assert attempt["state"] == "ended" and all(n["released_at"] for n in attempt["nodes"])
    assert _job(client, job["id"])["state"] == "cancelling"
    app.state.loops.monitor_once()
    assert _job(client, job["id"])["state"] == "cancelled"
