"""Time limits: an attempt past its job's time_limit_s is stopped and the job fails, no recovery."""

from __future__ import annotations

from control_plane.services import limits
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
    attempts = client.get(f"/v1/jobs/{limited['id']}/attempts", headers=ADMIN).json()
    assert attempts[0]["outcome"] == "failed" and attempts[0]["state"] == "ended"
