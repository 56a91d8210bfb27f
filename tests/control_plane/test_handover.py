"""Handover of parked parts (issue 14, in-process restart), against real PostgreSQL: a restartable job's
healthy part, parked by its agent, is taken over by the next attempt on exactly its GPUs in the
scheduling pass's transaction (leases transferred, never two owners or none), and nothing of it
applies to a job that is not restartable."""

from __future__ import annotations

import uuid

from sqlalchemy import select

from control_plane.db import session_scope
from control_plane.models import AttemptPart, Event, GpuLease
from control_plane.services.locks import lock_job
from control_plane.services.runs import handover
from tests.control_plane.helpers import start_running
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


def _specs(agents) -> dict[str, dict]:
    return {a.name: spec for a in agents for spec in a.heartbeat()["assignments"]}


_start = start_running


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
        part = s.scalar(select(AttemptPart).where(AttemptPart.attempt_id == uuid.UUID(old["attempt_id"]),
                                                  AttemptPart.node_id == uuid.UUID(alive.node_id)))
        assert part is not None and part.state == "gone" and part.released_at is not None
        kinds = set(s.scalars(select(Event.kind).where(Event.attempt_id == part.attempt_id)))
        assert {"part.handed_over", "leases.handed_over"} <= kinds
        adopter = s.scalar(select(AttemptPart).where(AttemptPart.attempt_id == uuid.UUID(new[alive.name]["attempt_id"]),
                                                     AttemptPart.node_id == uuid.UUID(alive.node_id)))
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


def _stop_ref(agent, spec) -> dict:
    """The stop order the agent's desired state gives for ``spec`` (an agent that holds it at its version)."""
    r = agent.client.post("/v1/agent/heartbeat", headers=agent.headers, json={
        "agent_instance": agent.instance, "seq": 1000, "attempts": [{"attempt_id": spec["attempt_id"]}],
        "known": [{"attempt_id": spec["attempt_id"], "version": spec["version"]}]})
    assert r.status_code == 200, r.text
    (ref,) = [u for u in r.json()["unchanged"] if u["attempt_id"] == spec["attempt_id"]]
    return ref


def _fail_with(app, job_id: str, node_id: str, *, hung: bool = False, kind: str = "exit_code") -> None:
    """The job's current attempt fails as the watchdog (hung) or a worker's exit would fail it."""
    from control_plane.clock import now
    from control_plane.models import Job
    from control_plane.services.runs import attempts
    from control_plane.services.runs.fencing import lock_attempt
    with session_scope(app.state.session_factory) as s:
        current = s.get(Job, uuid.UUID(job_id)).current_attempt_id
        locked = lock_attempt(s, current)
        assert locked is not None
        job, attempt = locked
        if hung:
            attempt.hung_since = now()
            attempts.fail_attempt(s, job, attempt, "hung: step 3 has not advanced", node_id=uuid.UUID(node_id))
        else:
            attempts.fail_attempt(s, job, attempt, "rank 1 exited", node_id=uuid.UUID(node_id), kind=kind)
        s.commit()


def test_the_blamed_node_and_a_hung_attempt_are_never_parked_nor_taken_over(app, client, schedule):
    """Finding 1: a hang fails an attempt whose workers all run (they are the hung processes), and the
    blamed node's own part is the cause: neither may be parked, offered, or adopted."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    job, specs = _start(client, schedule, agents, restartable=True)
    blamed, healthy = [a for a in agents if a.name in specs]
    _fail_with(app, job["id"], blamed.node_id, hung=True)
    for agent in (blamed, healthy):
        spec = specs[agent.name]
        assert _stop_ref(agent, spec)["handover_ok"] is False
        r = agent.status(spec, "parked", workers=workers_for(spec, "running"))
        assert r.status_code == 409 and "hung" in r.json()["detail"], r.text
    with session_scope(app.state.session_factory) as s:
        assert handover.parked_parts(s, [uuid.UUID(job["id"])]) == {}


def test_only_a_healthy_node_is_parked_and_taken_over_after_a_peer_exits(app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    job2, specs2 = _start(client, schedule, agents, restartable=True)
    blamed, healthy = [a for a in agents if a.name in specs2]
    _fail_with(app, job2["id"], blamed.node_id)
    assert _stop_ref(blamed, specs2[blamed.name])["handover_ok"] is False
    assert _stop_ref(healthy, specs2[healthy.name])["handover_ok"] is True
    r = blamed.status(specs2[blamed.name], "parked", workers=workers_for(specs2[blamed.name], "running"))
    assert r.status_code == 409 and "blamed" in r.json()["detail"], r.text
    r = healthy.status(specs2[healthy.name], "parked", workers=workers_for(specs2[healthy.name], "running"))
    assert r.status_code == 200 and r.json()["stop"] and r.json()["handover_ok"], r.text
    with session_scope(app.state.session_factory) as s:
        parked = handover.parked_parts(s, [uuid.UUID(job2["id"])])[uuid.UUID(job2["id"])]
    assert set(parked) == {healthy.node_id}
    # Re-checked under the locks: a part whose node became the blamed one is not taken over.
    from control_plane.models import Attempt
    with session_scope(app.state.session_factory) as s:
        s.get(Attempt, uuid.UUID(specs2[healthy.name]["attempt_id"])).failed_node_id = uuid.UUID(healthy.node_id)
        s.commit()
        locked = lock_job(s, uuid.UUID(job2["id"]))
        assert locked is not None
        assert handover.take_over(s, locked, parked, {healthy.node_id: tuple(specs2[healthy.name]["gpu_indices"])}) \
            is False
        assert handover.parked_parts(s, [uuid.UUID(job2["id"])]) == {}


def test_a_cancelled_job_parks_nothing(app, client, schedule):
    """Finding 2: every end of an attempt tells its parts to stop, but only a failure the job recovers
    from may park them; the stop says so, a parked report otherwise is refused, and a part parked
    before the job was cancelled is no longer offered."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    job, specs = _start(client, schedule, agents, restartable=True)
    spec = specs[agents[0].name] if agents[0].name in specs else next(iter(specs.values()))
    owner = next(a for a in agents if a.name in specs and specs[a.name] is spec)
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
    r = owner.status(spec, "running", workers=workers_for(spec, "running"))
    assert r.status_code == 200 and r.json()["stop"] is True and r.json()["handover_ok"] is False
    assert _stop_ref(owner, spec)["handover_ok"] is False
    r = owner.status(spec, "parked", workers=workers_for(spec, "running"))
    assert r.status_code == 409 and "not recovering" in r.json()["detail"], r.text


def test_a_job_out_of_failures_or_cancelled_while_parked_parks_nothing(app, client, schedule):
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3, 4, 5)]
    job, specs = _start(client, schedule, agents, restartable=True, max_failures=0)
    dead, alive = _fail_one(agents, specs)
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "failed"
    r = alive.status(specs[alive.name], "parked", workers=workers_for(specs[alive.name], "running"))
    assert r.status_code == 409 and "not recovering" in r.json()["detail"], r.text

    job, specs = _start(client, schedule, agents, restartable=True)
    _, alive = _fail_one(agents, specs)
    spec = specs[alive.name]
    assert alive.status(spec, "parked", workers=workers_for(spec, "running")).status_code == 200
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
    r = alive.status(specs[alive.name], "parked", workers=workers_for(specs[alive.name], "running"))
    assert r.status_code == 409 and "not recovering" in r.json()["detail"], r.text
    assert _stop_ref(alive, specs[alive.name])["handover_ok"] is False
    with session_scope(app.state.session_factory) as s:
        assert handover.parked_parts(s, [uuid.UUID(job["id"])]) == {}


def test_a_part_told_to_stop_before_its_first_report_may_be_parked(app, client, schedule):
    """Finding 8: the agent's first report of a part may already say parked (the stop came before its
    running report went out): assigned -> parked is a transition, not a 409."""
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3)]
    client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=1, max_failures=3, restartable=True),
                headers=ADMIN).raise_for_status()
    assert schedule() == 1
    specs = _specs(agents)
    dead, alive = _fail_one(agents, specs)
    r = alive.status(specs[alive.name], "parked", workers=workers_for(specs[alive.name], "running"))
    assert r.status_code == 200, r.text
    with session_scope(app.state.session_factory) as s:
        part = s.scalar(select(AttemptPart).where(AttemptPart.node_id == uuid.UUID(alive.node_id)))
        assert part is not None and part.state == "parked"
    assert dead.name != alive.name


def test_a_handover_does_not_take_a_replacement_gpu_beyond_the_tenants_quota(app, client, schedule):
    """Finding 6: the GPUs a handover needs besides its parked ones count against the tenant's quota,
    as the ordinary pass counts them: over it, no handover (the job waits, its parts stop as usual)."""
    assert client.put("/v1/tenants/vision", json={"gpu_quota": 3}, headers=ADMIN).status_code == 200
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in (1, 2, 3, 4)]
    job, specs = _start(client, schedule, agents, restartable=True, tenant="vision")
    other = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, tenant="vision"), headers=ADMIN)
    assert other.status_code in (200, 201, 202) and schedule() == 1
    assert client.put("/v1/tenants/vision", json={"gpu_quota": 2}, headers=ADMIN).status_code == 200
    dead, alive = _fail_one(agents, specs)
    old = specs[alive.name]
    assert alive.status(old, "parked", workers=workers_for(old, "running")).status_code == 200
    # vision holds 2 GPUs (the parked part's, the other job's); the replacement would be a third.
    assert schedule() == 0
    assert _active_leases(app, alive.node_id) == [uuid.UUID(old["attempt_id"])]
    with session_scope(app.state.session_factory) as s:
        assert not s.scalar(select(AttemptPart).where(AttemptPart.adopts_attempt_id.is_not(None)))
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "recovering"
    assert dead.name != alive.name
