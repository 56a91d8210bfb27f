"""Handover of parked parts (issue 14, in-process restart), against real PostgreSQL: a restartable job's
healthy part, parked by its agent, is taken over by the next attempt on exactly its GPUs in the
scheduling pass's transaction (leases transferred, never two owners or none), and nothing of it
applies to a job that is not restartable."""

from __future__ import annotations

import uuid

from sqlalchemy import select

from control_plane.db import session_scope
from control_plane.models import AttemptNode, Event, GpuLease
from control_plane.services import handover
from control_plane.services.locks import lock_job
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


def _specs(agents) -> dict[str, dict]:
    return {a.name: spec for a in agents for spec in a.heartbeat()["assignments"]}


def _start(client, schedule, agents, **body):
    job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1, max_failures=3, **body),
                      headers=ADMIN).json()
    assert schedule() == 1
    specs = _specs(agents)
    for agent in agents:
        if agent.name in specs:
            spec = specs[agent.name]
            r = agent.status(spec, "running", workers=workers_for(spec, "running"))
            assert r.status_code == 200, r.text
    return job, specs


def _fail_one(agents, specs):
    """Node rank 1's worker dies; the other node's part is told to stop (its workers still alive)."""
    (dead,) = [a for a in agents if a.name in specs and specs[a.name]["node_rank"] == 1]
    (alive,) = [a for a in agents if a.name in specs and specs[a.name]["node_rank"] == 0]
    spec = specs[dead.name]
    r = dead.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1), processes_alive=False)
    assert r.status_code == 200, r.text
    held = specs[alive.name]["attempt_id"]
    assert held not in {s["attempt_id"] for s in alive.heartbeat([held])["assignments"]}  # told to stop
    return dead, alive


def _active_leases(app, node_id: str) -> list[uuid.UUID]:
    with session_scope(app.state.session_factory) as s:
        return list(s.scalars(select(GpuLease.attempt_id).where(GpuLease.node_id == uuid.UUID(node_id),
                                                                GpuLease.released_at.is_(None))))


def test_a_parked_part_is_handed_over_on_its_gpus_and_the_old_attempt_ends(app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    job, specs = _start(client, schedule, agents, restartable=True)
    dead, alive = _fail_one(agents, specs)
    old = specs[alive.name]
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "recovering"
    r = alive.status(old, "parked", workers=workers_for(old, "running"))
    assert r.status_code == 200, r.text
    assert _active_leases(app, alive.node_id) == [uuid.UUID(old["attempt_id"])]  # parked: still its GPUs

    assert schedule() == 1
    new = _specs(agents)
    assert new[alive.name]["attempt_id"] != old["attempt_id"]
    assert new[alive.name]["adopts"] == old["attempt_id"]
    assert new[alive.name]["gpu_indices"] == old["gpu_indices"]
    assert all(spec["adopts"] is None for name, spec in new.items() if name != alive.name)
    # One owner: the new attempt, in the same transaction that released the parked part's lease.
    assert _active_leases(app, alive.node_id) == [uuid.UUID(new[alive.name]["attempt_id"])]
    with session_scope(app.state.session_factory) as s:
        part = s.scalar(select(AttemptNode).where(AttemptNode.attempt_id == uuid.UUID(old["attempt_id"]),
                                                  AttemptNode.node_id == uuid.UUID(alive.node_id)))
        assert part is not None and part.state == "gone" and part.released_at is not None
        kinds = set(s.scalars(select(Event.kind).where(Event.attempt_id == part.attempt_id)))
        assert {"part.handed_over", "leases.handed_over"} <= kinds
        adopter = s.scalar(select(AttemptNode).where(AttemptNode.attempt_id == uuid.UUID(new[alive.name]["attempt_id"]),
                                                     AttemptNode.node_id == uuid.UUID(alive.node_id)))
        assert adopter is not None and adopter.adopts_attempt_id == part.attempt_id
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert {a["number"]: a["state"] for a in attempts}[1] == "ended"
    # The old attempt's token is stale now: its parked workers' reports are refused.
    r = alive.status(old, "running", workers=workers_for(old, "running"))
    assert r.status_code == 409
    assert len(new) == 2 and dead.name != alive.name


def test_a_part_is_parked_only_when_its_job_is_restartable_and_it_was_told_to_stop(app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2)]
    _, specs = _start(client, schedule, agents, restartable=True)
    spec = specs[agents[0].name]
    r = agents[0].status(spec, "parked", workers=workers_for(spec, "running"))
    assert r.status_code == 409 and "not told to stop" in r.json()["detail"]

    plain = [FakeAgentSession(client, f"plain-{i}", 1) for i in (1, 2)]
    job, specs = _start(client, schedule, plain)
    assert all(s["restartable"] is False and s["adopts"] is None for s in specs.values())
    dead, alive = _fail_one(plain, specs)
    old = specs[alive.name]
    r = alive.status(old, "parked", workers=workers_for(old, "running"))
    assert r.status_code == 409 and "not restartable" in r.json()["detail"]
    # As today: the healthy part stops, its lease is released, the next attempt starts cold.
    r = alive.status(old, "stopped", exit_code=-15, workers=workers_for(old, "exited", -15), processes_alive=False)
    assert r.status_code == 200, r.text
    assert schedule() == 1
    assert all(s["adopts"] is None for s in _specs(plain).values())


def test_a_parked_part_stopped_meanwhile_is_not_taken_over(app, client, schedule):
    """The pass read the part parked, then its agent's handover timeout stopped it: the transfer
    refuses (nothing changes), and the next pass places the job afresh."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    job, specs = _start(client, schedule, agents, restartable=True)
    _, alive = _fail_one(agents, specs)
    old = specs[alive.name]
    assert alive.status(old, "parked", workers=workers_for(old, "running")).status_code == 200
    with session_scope(app.state.session_factory) as s:
        parked = handover.parked_parts(s, [uuid.UUID(job["id"])])[uuid.UUID(job["id"])]
    assert set(parked) == {alive.node_id}
    r = alive.status(old, "stopped", exit_code=-15, workers=workers_for(old, "exited", -15))
    assert r.status_code == 200, r.text
    with session_scope(app.state.session_factory) as s:
        locked = lock_job(s, uuid.UUID(job["id"]))
        assert locked is not None
        assert handover.take_over(s, locked, parked, {alive.node_id: tuple(old["gpu_indices"])}) is False
    assert _active_leases(app, alive.node_id) == [uuid.UUID(old["attempt_id"])]
    with session_scope(app.state.session_factory) as s:
        assert handover.parked_parts(s, [uuid.UUID(job["id"])]) == {}


def test_a_next_attempt_placed_elsewhere_takes_nothing_over_and_the_parked_part_turns_stale(app, client, schedule):
    """The parked node is cordoned: the pass places the job on other nodes, adopts nothing, leaves the
    parked part's lease to it, and the parked part's next report is refused as stale (its agent then
    stops it and the heartbeat that no longer lists it releases the GPU)."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    _, specs = _start(client, schedule, agents, restartable=True)
    dead, alive = _fail_one(agents, specs)
    old = specs[alive.name]
    assert alive.status(old, "parked", workers=workers_for(old, "running")).status_code == 200
    assert client.post(f"/v1/nodes/{alive.node_id}/cordon", headers=ADMIN).status_code == 200
    assert schedule() == 1
    new = _specs([a for a in agents if a is not alive])
    assert len(new) == 2 and all(s["adopts"] is None for s in new.values())
    assert _active_leases(app, alive.node_id) == [uuid.UUID(old["attempt_id"])]
    assert alive.status(old, "parked", workers=workers_for(old, "running")).status_code == 409
    alive.heartbeat([])
    assert _active_leases(app, alive.node_id) == []
    assert dead.name in new
