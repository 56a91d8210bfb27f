"""No attempt is orphaned on a part its agent never picks up (issue 9, finding 5), on real
PostgreSQL: a part still ``assigned`` after ``attempt_launch_timeout_s`` fails its attempt with a
reason, and a pass never places a gang on a node that was declared lost or cordoned after it read
the cluster."""

from __future__ import annotations

import uuid

from sqlalchemy import select, update

from control_plane.db import session_scope
from control_plane.models import Job, Node
from control_plane.scheduler.allocate import _admit
from control_plane.scheduler.model import Placement
from tests.factories import ADMIN, FakeAgentSession, job_body


def _job(client, job_id):
    return client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def test_a_part_never_confirmed_launching_fails_its_attempt_after_the_launch_timeout(
        clock, app, client, schedule, settings):
    agent = FakeAgentSession(client, "gpu-1", 1)
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1, max_failures=3),
                      headers=ADMIN).json()
    assert schedule() == 1
    # The agent heartbeats (so its node is not lost) but never reports the attempt.
    [spec] = agent.heartbeat()["assignments"]
    monitor = app.state.loops.monitor_once
    clock.advance(settings.attempt_launch_timeout_s / 2)
    agent.heartbeat()
    monitor()
    assert _job(client, job["id"])["state"] == "starting"  # not yet

    clock.advance(settings.attempt_launch_timeout_s / 2 + 1)
    agent.heartbeat()
    monitor()
    view = _job(client, job["id"])
    assert view["state"] == "recovering"
    [attempt] = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["outcome"] == "failed" and attempt["failed_node"] == "gpu-1"
    assert "not confirmed launching" in attempt["end_reason"] and "gpu-1" in attempt["end_reason"]
    # The next heartbeat (the attempt not listed) releases its GPU, and the job is placed again.
    agent.heartbeat()
    assert client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"][0]["state"] == "ended"
    assert schedule() == 1
    assert agent.heartbeat()["assignments"][0]["attempt_id"] != spec["attempt_id"]


def test_admit_rechecks_the_nodes_under_lock(app, client):
    agent = FakeAgentSession(client, "gpu-2", 1)
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
    factory = app.state.session_factory
    with session_scope(factory) as s:
        # The pass read the node as ready; then it was declared lost and cordoned, and committed.
        s.execute(update(Node).where(Node.name == "gpu-2").values(state="lost", schedulable=False))
    with session_scope(factory) as s:
        from control_plane.scheduler.allocate import NodeRef
        node = s.get(Node, uuid.UUID(agent.node_id))
        admitted = _admit(s, app.state.settings, [Placement(job_id=job["id"], nodes=((agent.node_id, (0,)),))],
                          {agent.node_id: NodeRef(node.id, node.name, node.address)})
        assert admitted == []
        assert s.scalar(select(Job.state).where(Job.id == uuid.UUID(job["id"]))) == "queued"
