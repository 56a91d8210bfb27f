"""Time limits: an attempt past its job's time_limit_s is stopped and the job fails, no recovery."""

from __future__ import annotations

import uuid

from sqlalchemy import select

from control_plane.models import Attempt, AttemptPart, Job
from control_plane.services.runs import attempts, limits
from control_plane.services.runs.jobs import set_job_state
from tests.control_plane.helpers import get_job, submit
from tests.factories import ADMIN, FakeAgentSession, workers_for


def test_time_limit_stops_the_attempt_and_fails_the_job(client, schedule, app, clock):
    agent = FakeAgentSession(client, "node-1")
    limited = submit(client, num_nodes=1, gpus_per_node=1, time_limit_s=60, max_failures=3)
    free = submit(client, num_nodes=1, gpus_per_node=1)
    assert schedule() == 2
    specs = {s["job_id"]: s for s in agent.heartbeat()["assignments"]}
    for spec in specs.values():
        agent.status(spec, "running", workers=workers_for(spec, "running"))
    factory = app.state.session_factory
    clock.advance(59)
    with factory() as s:
        assert limits.enforce_time_limits(s) == []
        s.commit()
    clock.advance(2)
    assert app.state.loops.limits_once() == 1
    job = get_job(client, limited["id"])
    assert job["state"] == "failed" and job["end_reason"] == "time limit of 60s exceeded"
    assert job["failures"] == 0  # not a failure to recover from
    both = [specs[limited["id"]]["attempt_id"], specs[free["id"]]["attempt_id"]]
    assert [s["job_id"] for s in agent.heartbeat(both)["assignments"]] == [free["id"]]  # told to stop
    assert len(job["allocation"]) == 1  # its GPU stays leased until its processes are gone
    agent.heartbeat([specs[free["id"]]["attempt_id"]])
    assert get_job(client, limited["id"])["allocation"] == []
    assert get_job(client, free["id"])["state"] == "running"
    assert app.state.loops.limits_once() == 0
    attempts = client.get(f"/v1/jobs/{limited['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempts[0]["outcome"] == "failed" and attempts[0]["state"] == "ended"


def test_an_ending_written_without_autoflush_is_not_lost_to_the_reload_of_the_locks(client, schedule, app, clock):
    """Ending an attempt and releasing its node in one session, without autoflush (as a batch
    writer would): the locks' reload must not overwrite the unflushed ending, or the time-limit
    loop later fails a job that had succeeded (bench/scheduler.py once counted thousands)."""
    FakeAgentSession(client, "node-1")
    job = submit(client, num_nodes=1, gpus_per_node=1, time_limit_s=60)
    assert schedule() == 1
    factory = app.state.session_factory
    with factory() as s, s.no_autoflush:
        row = s.get(Job, uuid.UUID(job["id"]))
        attempt = s.get(Attempt, row.current_attempt_id)
        attempts.end_attempt(s, attempt, outcome="succeeded", reason="finished")
        set_job_state(s, row, "succeeded", "attempt 1 finished")
        parts = s.scalars(select(AttemptPart.id).where(AttemptPart.attempt_id == attempt.id)).all()
        attempts.release_parts(s, parts)
        s.commit()
        attempts.finish_released(s, [attempt.id])  # after the release committed, as its callers do
        s.commit()
    clock.advance(120)
    assert app.state.loops.limits_once() == 0
    view = get_job(client, job["id"])
    assert view["state"] == "succeeded" and view["allocation"] == []
    listed = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert listed[0]["outcome"] == "succeeded" and listed[0]["state"] == "ended"
