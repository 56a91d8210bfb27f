"""Retention (issue 11, finding 9): logs, events and progress samples older than their settings are
deleted in batches; newer ones and unlimited settings keep everything."""

from __future__ import annotations

from sqlalchemy import func, select, update

from control_plane.db import session_scope
from control_plane.models import Event, LogChunk
from control_plane.services.runs import retention
from tests.factories import ADMIN, FakeAgentSession, job_body


def test_old_logs_and_events_are_deleted_in_batches(app, client, clock):
    agent = FakeAgentSession(client, "node-1", 1)
    job = client.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
    app.state.loops.schedule_once()
    spec = agent.heartbeat()["assignments"][0]
    chunks = [{"rank": 0, "stream": "stdout", "offset": i, "data": f"line {i}\n"} for i in range(7)]
    r = client.post(f"/v1/agent/attempts/{spec['attempt_id']}/logs", headers=agent.headers,
                    json={"fencing_token": spec["fencing_token"], "node_rank": 0, "chunks": chunks})
    assert r.status_code == 200, r.text
    for step, age_days in ((1, 40), (2, 0)):  # progress samples: one old, one new
        agent.status(spec, "running", progress={"step": step, "at": (clock() - _days(age_days)).isoformat()})
        clock.advance(10)  # past services/progress.SAMPLE_S: each report is sampled
    factory = app.state.session_factory
    with session_scope(factory) as s:
        events = s.scalar(select(func.count()).select_from(Event))
        # The first five log lines and every event so far are 40 days old.
        s.execute(update(LogChunk).where(LogChunk.offset < 5).values(created_at=clock() - _days(40)))
        s.execute(update(Event).values(created_at=clock() - _days(40)))
    assert events >= 3
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)  # one more, new event

    assert retention.apply(factory, log_days=0, event_days=0, batch=2) == (0, 0)  # 0: keep forever
    assert retention.apply(factory, log_days=30, event_days=90, batch=2) == (5, 0)
    assert retention.apply(factory, log_days=30, event_days=30, batch=2) == (0, events)
    text = client.get(f"/v1/jobs/{job['id']}/logs", params={"prefix": "false"}, headers=ADMIN).text
    assert text == "line 5\nline 6\n"
    left = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()["items"]
    history = client.get(f"/v1/jobs/{job['id']}/progress", headers=ADMIN).json()["items"]
    assert [p["step"] for p in history] == [2]  # the charts' history goes with the events
    assert "job.cancelling" in [e["kind"] for e in left] and "job.queued" not in [e["kind"] for e in left]


def _days(n: float):
    from datetime import timedelta

    return timedelta(days=n)
