"""Issue 9 finding 2: the heartbeat service draws no verdict from a missing message. An attempt
the node still lists (its final status not acknowledged yet) is never declared vanished, however
late its final status comes; only an attempt the node no longer lists at all can vanish."""

from __future__ import annotations

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


def _heartbeat(agent: FakeAgentSession, attempts: list[dict]) -> dict:
    agent.seq += 1
    r = agent.client.post("/v1/agent/heartbeat", headers=agent.headers,
                          json={"agent_instance": agent.instance, "seq": agent.seq, "attempts": attempts})
    assert r.status_code == 200, r.text
    return r.json()


def _start(client, schedule):
    a, b = FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")
    job = client.post("/v1/jobs", json=job_body(max_failures=0), headers=ADMIN).json()
    assert schedule() == 1
    specs = [agent.heartbeat()["assignments"][0] for agent in (a, b)]
    for agent, spec in zip((a, b), specs, strict=True):
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    return job, (a, b), specs


def _job(client, job_id):
    return client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def test_listed_attempt_with_pending_final_status_never_vanishes(client, schedule, clock):
    job, (a, b), (sa, sb) = _start(client, schedule)
    b.status(sb, "exited", exit_code=0, workers=workers_for(sb, "exited", 0))
    b.heartbeat([])
    # Node 1's processes ended, its final status is delayed far past the vanish timeout (a slow
    # commit, a partition of the status endpoint): the node still lists the attempt, every second.
    pending = [{"attempt_id": sa["attempt_id"], "processes_alive": False, "final_status_pending": True}]
    for _ in range(6):
        clock.advance(10)
        _heartbeat(a, pending)
        _heartbeat(b, [])
        assert _job(client, job["id"])["state"] == "running"
    result = {"final_loss": 0.5}
    a.status(sa, "exited", exit_code=0, workers=workers_for(sa, "exited", 0), result=result)
    _heartbeat(a, [])
    done = _job(client, job["id"])
    assert done["state"] == "succeeded" and done["allocation"] == []


def test_unlisted_silent_attempt_still_vanishes(client, schedule, clock):
    job, (a, b), (sa, _) = _start(client, schedule)
    clock.advance(30)
    _heartbeat(a, [])  # no longer listed at all and silent for 30 s: its processes vanished
    failed = _job(client, job["id"])
    assert failed["state"] == "failed" and "vanished" in failed["end_reason"]


def test_old_agent_heartbeat_without_the_new_field_parses(client, schedule, clock):
    job, (a, b), (sa, sb) = _start(client, schedule)
    clock.advance(30)
    _heartbeat(a, [{"attempt_id": sa["attempt_id"]}])  # processes_alive defaults to True
    _heartbeat(b, [{"attempt_id": sb["attempt_id"], "processes_alive": True}])
    assert _job(client, job["id"])["state"] == "running"


def _workers_view(client, job_id):
    (attempt,) = client.get(f"/v1/jobs/{job_id}/attempts", headers=ADMIN).json()["items"]
    return {n["node_name"]: n["workers"] for n in attempt["nodes"]}, attempt


def test_surviving_workers_show_as_exited_once_their_part_is_released(client, schedule, clock):
    # Finding 19: node 1's workers were running when node 2's rank failed; node 1's part is then
    # stopped and its processes confirmed gone without any final worker exit reaching the control
    # plane. The attempt view must not keep showing those workers as running.
    job, (a, b), (sa, sb) = _start(client, schedule)
    workers = workers_for(sb, "exited", 0)
    workers[1].update(exit_code=3)
    b.status(sb, "exited", exit_code=1, workers=workers)
    views, attempt = _workers_view(client, job["id"])
    assert attempt["outcome"] == "failed"
    assert {w["state"] for w in views["node-1"]} == {"running"}  # not released yet: still running
    _heartbeat(a, [])  # node 1 confirms its processes gone (its stop report never came)
    _heartbeat(b, [])
    views, attempt = _workers_view(client, job["id"])
    assert attempt["state"] == "ended"
    for w in views["node-1"]:
        assert (w["state"], w["exit_code"]) == ("exited", None)
        assert w["reason"] and "no exit was recorded" in w["reason"]
    # Recorded exits keep their code and carry no reason.
    assert sorted((w["exit_code"], w["reason"]) for w in views["node-2"]) == [(0, None), (3, None)]
    # A late report of the real exit only adds the code (monotonic: the state never goes back).
    a.status(sa, "stopped", workers=workers_for(sa, "exited", -15))
    views, _ = _workers_view(client, job["id"])
    assert {(w["state"], w["exit_code"]) for w in views["node-1"]} <= {("exited", None), ("exited", -15)}
