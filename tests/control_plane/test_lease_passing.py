"""Lease passing (issue 27), against real PostgreSQL: a failed attempt's GPUs on its healthy nodes
pass to its job's next attempt in the scheduling pass that follows the failure, before any node has
confirmed its processes gone; the old parts stay held until they are, and a part that follows one is
never released before it, so a GPU whose processes may be alive is leased to the job at every commit."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from control_plane.app import create_app
from control_plane.db import session_scope
from control_plane.models import AttemptPart, Checkpoint, Event, GpuLease
from control_plane.services.runs import attempts, handover
from tests.control_plane.helpers import start_running
from tests.factories import ADMIN, FakeAgentSession, workers_for


def _specs(agents: list[FakeAgentSession], alive: dict[str, list[str]] | None = None) -> dict[str, dict[str, Any]]:
    """Each agent's new assignments; its heartbeat lists the attempts in ``alive`` (by agent name) as
    having live processes (an empty list confirms every other attempt's processes gone)."""
    alive = alive or {}
    return {a.name: spec for a in agents for spec in a.heartbeat(alive.get(a.name, []))["assignments"]}


_start = start_running


def _fail_rank_one(agents: list[FakeAgentSession], specs: dict[str, dict[str, Any]]):
    """Node rank 1's worker exits 1 and its processes are gone (released at once); node rank 0 is told
    to stop, its processes still alive (its part held)."""
    (dead,) = [a for a in agents if a.name in specs and specs[a.name]["node_rank"] == 1]
    (alive,) = [a for a in agents if a.name in specs and specs[a.name]["node_rank"] == 0]
    spec = specs[dead.name]
    r = dead.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1), processes_alive=False)
    assert r.status_code == 200, r.text
    return dead, alive


def _leases(app, node_id: str) -> list[uuid.UUID]:
    with session_scope(app.state.session_factory) as s:
        return list(s.scalars(select(GpuLease.attempt_id).where(GpuLease.node_id == uuid.UUID(node_id),
                                                                GpuLease.released_at.is_(None))))


def _part(app, attempt_id: str, node_id: str) -> AttemptPart:
    with session_scope(app.state.session_factory) as s:
        part = s.scalar(select(AttemptPart).where(AttemptPart.attempt_id == uuid.UUID(attempt_id),
                                                  AttemptPart.node_id == uuid.UUID(node_id)))
        assert part is not None
        s.expunge(part)
        return part


def test_the_next_attempt_takes_the_healthy_nodes_gpus_before_they_are_released(app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, agents)
    dead, alive = _fail_rank_one(agents, specs)
    old = specs[alive.name]
    assert _part(app, old["attempt_id"], alive.node_id).released_at is None  # its processes still run

    assert schedule() == 1  # no release of the healthy node was waited for
    new = _specs(agents, {alive.name: [old["attempt_id"]]})
    assert new[alive.name]["attempt_id"] != old["attempt_id"]
    assert new[alive.name]["gpu_indices"] == old["gpu_indices"] and new[alive.name]["adopts"] is None
    # One owner, the job's next attempt, in the transaction that released the old attempt's lease.
    assert _leases(app, alive.node_id) == [uuid.UUID(new[alive.name]["attempt_id"])]
    before = _part(app, old["attempt_id"], alive.node_id)
    assert before.released_at is None and before.desired == "stop"  # held until its node confirms
    follower = _part(app, new[alive.name]["attempt_id"], alive.node_id)
    assert follower.follows_part_id == before.id
    # The blamed node's GPU was released by its own final report and placed afresh: nothing follows there.
    assert _part(app, new[dead.name]["attempt_id"], dead.node_id).follows_part_id is None
    with session_scope(app.state.session_factory) as s:
        kinds = set(s.scalars(select(Event.kind).where(Event.attempt_id == uuid.UUID(old["attempt_id"]))))
    assert "leases.passed" in kinds

    # The healthy node confirms the old processes gone: the old part is released (no lease left to
    # give back), the old attempt ends, and the new part keeps its lease.
    alive.heartbeat([])
    assert _part(app, old["attempt_id"], alive.node_id).released_at is not None
    with session_scope(app.state.session_factory) as s:
        said = s.scalar(select(Event.message).where(Event.kind == "leases.released",
                                                    Event.attempt_id == uuid.UUID(old["attempt_id"]),
                                                    Event.node_id == uuid.UUID(alive.node_id)))
    assert said == "node rank 0 stopped; its GPU leases had passed to the job's next attempt"
    assert _leases(app, alive.node_id) == [uuid.UUID(new[alive.name]["attempt_id"])]
    items = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    states = {a["number"]: a["state"] for a in items}
    assert states == {1: "ended", 2: "starting"}


def test_a_part_that_follows_is_not_released_before_the_part_it_follows(app, client, schedule):
    """The job is cancelled while the old processes still run: the new part (never started by its
    agent) is not listed, but its GPU stays leased until the old part's processes are confirmed gone."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, agents)
    dead, alive = _fail_rank_one(agents, specs)
    old = specs[alive.name]
    assert schedule() == 1
    new = _specs(agents, {alive.name: [old["attempt_id"]]})[alive.name]
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code == 200

    dead.heartbeat([])  # its new part never started: released
    alive.heartbeat([old["attempt_id"]])  # the old attempt's processes are alive; the new part is not listed
    assert _part(app, new["attempt_id"], alive.node_id).released_at is None
    assert _leases(app, alive.node_id) == [uuid.UUID(new["attempt_id"])]
    cluster = client.get("/v1/cluster", headers=ADMIN).json()
    assert cluster["capacity"]["gpus_free"] == 1  # the blamed node's only

    alive.heartbeat([])  # gone: the old part first, then (this heartbeat or the next) the new one
    alive.heartbeat([])
    assert _part(app, old["attempt_id"], alive.node_id).released_at is not None
    assert _part(app, new["attempt_id"], alive.node_id).released_at is not None
    assert _leases(app, alive.node_id) == []
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "cancelled"


def test_a_job_that_parks_passes_nothing(app, client, schedule):
    """A restartable job's healthy part is parked and handed over with its workers (test_handover.py),
    so the pass does not start it cold by passing its leases: the job waits for the part to be parked."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, agents, restartable=True)
    _, alive = _fail_rank_one(agents, specs)
    with session_scope(app.state.session_factory) as s:
        assert handover.passable_parts(s, [uuid.UUID(job["id"])]) == {}
    assert schedule() == 0
    old = specs[alive.name]
    assert alive.status(old, "parked", workers=workers_for(old, "running")).status_code == 200
    assert schedule() == 1
    new = _specs(agents, {alive.name: [old["attempt_id"]]})[alive.name]
    assert new["adopts"] == old["attempt_id"]
    assert _part(app, new["attempt_id"], alive.node_id).follows_part_id is None


def test_a_follower_is_not_failed_by_the_launch_timeout_while_it_waits_for_the_processes_it_follows(
        app, client, schedule):
    """Its node cannot launch it before the old processes are gone: the launch timeout counts only
    once they are (as a job waiting for a lease has no timeout); then it applies as to any part."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, agents)
    dead, alive = _fail_rank_one(agents, specs)
    old = specs[alive.name]
    assert schedule() == 1
    new = _specs(agents, {alive.name: [old["attempt_id"]]})
    r = dead.status(new[dead.name], "running", workers=workers_for(new[dead.name], "running"))
    assert r.status_code == 200, r.text
    with session_scope(app.state.session_factory) as s:
        assert attempts.fail_unlaunched(s, timeout_s=0) == []
    alive.heartbeat([])  # the old processes are gone; the agent has not picked the new part up since
    with session_scope(app.state.session_factory) as s:
        assert attempts.fail_unlaunched(s, timeout_s=0) == [uuid.UUID(new[alive.name]["attempt_id"])]
    items = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    (second,) = [a for a in items if a["number"] == 2]
    assert "its agent never picked it up" in second["end_reason"], second["end_reason"]


def test_a_failure_during_a_save_passes_nothing(app, client, schedule):
    """A checkpoint of the failed attempt still collecting shards: the healthy nodes' reports may
    complete it while the attempt is the job's current one, so the next attempt waits for the
    releases as without passing."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, agents)
    with session_scope(app.state.session_factory) as s:
        s.add(Checkpoint(job_id=uuid.UUID(job["id"]), attempt_id=uuid.UUID(specs["node-1"]["attempt_id"]), step=10,
                         world_size=2, state="pending"))
    _fail_rank_one(agents, specs)
    with session_scope(app.state.session_factory) as s:
        assert handover.passable_parts(s, [uuid.UUID(job["id"])]) == {}
    assert schedule() == 0


def test_with_passing_off_the_next_attempt_waits_for_the_release(settings):
    app = create_app(settings.model_copy(update={"recovery_pass_leases": False}))
    with TestClient(app) as client:
        schedule = app.state.loops.schedule_once
        agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
        _, specs = _start(client, schedule, agents)
        _, alive = _fail_rank_one(agents, specs)
        assert schedule() == 0
        alive.heartbeat([])  # the old processes are gone: the next attempt is placed only now
        assert schedule() == 1
        new = _specs(agents)[alive.name]
        assert _part(app, new["attempt_id"], alive.node_id).follows_part_id is None
