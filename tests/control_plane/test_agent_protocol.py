"""The agent wire protocol over HTTP against real Postgres: fencing, monotonic merges,
lease release only after processes are gone, duplicates and reordering."""

from __future__ import annotations

import pytest

from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for


@pytest.fixture
def two_nodes(client):
    return FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")


def _start(client, schedule, agents, body=None):
    job = client.post("/v1/jobs", json=body or job_body(), headers=ADMIN).json()
    assert schedule() == 1
    specs = [a.heartbeat()["assignments"][0] for a in agents]
    return job, specs


def _job(client, job_id):
    return client.get(f"/v1/jobs/{job_id}", headers=ADMIN).json()


def test_full_run_to_success(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    assert sa["node_rank"] != sb["node_rank"]
    assert sa["rdzv_port"] == sb["rdzv_port"] and sa["rdzv_host"] == sb["rdzv_host"]
    for agent, spec in ((a, sa), (b, sb)):
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    assert _job(client, job["id"])["state"] == "running"
    result = {"final_loss": 1.5, "weights_sha256": "ab" * 32}
    rank0 = (a, sa) if sa["node_rank"] == 0 else (b, sb)
    other = (b, sb) if rank0[0] is a else (a, sa)
    rank0[0].status(rank0[1], "exited", exit_code=0, workers=workers_for(rank0[1], "exited", 0), result=result)
    assert _job(client, job["id"])["state"] == "running"  # the other node has not finished yet
    other[0].status(other[1], "exited", exit_code=0, workers=workers_for(other[1], "exited", 0))
    done = _job(client, job["id"])
    assert done["state"] == "succeeded" and done["result"] == result
    # Leases are released as each node confirms its processes are gone.
    assert len(done["allocation"]) == 2
    a.heartbeat([])
    b.heartbeat([])
    assert _job(client, job["id"])["allocation"] == []
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempts[0]["state"] == "ended" and attempts[0]["outcome"] == "succeeded"
    assert sorted(w["rank"] for n in attempts[0]["nodes"] for w in n["workers"]) == [0, 1, 2, 3]


def test_success_when_first_node_is_released_before_the_last_exit_report(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    a.status(sa, "exited", exit_code=0, workers=workers_for(sa, "exited", 0), result={"ok": True})
    a.heartbeat([])  # node 1's processes are gone: its leases are released first
    b.status(sb, "exited", exit_code=0, workers=workers_for(sb, "exited", 0))
    assert _job(client, job["id"])["state"] == "succeeded"


def test_one_dead_worker_fails_the_whole_attempt(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes, job_body(max_failures=0))
    a.status(sa, "running", workers=workers_for(sa, "running"))
    workers = workers_for(sb, "running")
    workers[1].update(state="exited", exit_code=-9)
    ack = b.status(sb, "running", workers=workers).json()
    assert ack["stop"] is True
    failed = _job(client, job["id"])
    assert failed["state"] == "failed" and "exited with code -9" in failed["end_reason"]
    # Every node is told to stop: the healthy node gets no assignment any more.
    assert a.heartbeat([sa["attempt_id"]])["assignments"] == []
    # Its leases stay held while its processes are alive, and are released once they are gone.
    assert len(_job(client, failed["id"])["allocation"]) == 2
    a.heartbeat([])
    b.heartbeat([])
    assert _job(client, job["id"])["allocation"] == []


def test_wrong_token_and_stale_attempt_are_refused(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes, job_body(max_failures=2))
    bad = a.status(sa, "running", token="not-the-token")
    assert bad.status_code == 409 and bad.json()["type"].endswith("stale-attempt")
    # Attempt 1 fails; after release the job is re-admitted as attempt 2.
    b.status(sb, "exited", exit_code=1, workers=workers_for(sb, "exited", 1))
    a.heartbeat([])
    b.heartbeat([])
    assert schedule() == 1
    new = a.heartbeat()["assignments"][0]
    assert new["attempt_number"] == 2 and new["fencing_token"] != sa["fencing_token"]
    assert new["rdzv_port"] != sa["rdzv_port"] or new["attempt_id"] != sa["attempt_id"]
    # A late report from attempt 1 (however late) is refused and changes nothing.
    late = a.status(sa, "running", workers=workers_for(sa, "running"),
                    progress={"step": 999, "loss": 0.1, "at": "2026-01-01T00:00:00Z"})
    assert late.status_code == 409 and "stale" in late.json()["detail"]
    view = _job(client, job["id"])
    assert view["progress"]["step"] is None and view["current_attempt"]["number"] == 2


def test_duplicate_and_reordered_reports_never_move_backwards(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    p = lambda step: {"step": step, "loss": 1.0 / step, "at": "2026-12-02T10:00:00Z"}  # noqa: E731
    a.status(sa, "running", workers=workers_for(sa, "running"), progress=p(20))
    a.status(sa, "running", workers=workers_for(sa, "running"), progress=p(20))
    a.status(sa, "launching", workers=workers_for(sa, "starting"), progress=p(10))  # old, delivered late
    view = _job(client, job["id"])
    assert view["progress"]["step"] == 20
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    part = next(n for n in attempts[0]["nodes"] if n["node_rank"] == sa["node_rank"])
    assert part["state"] == "running" and {w["state"] for w in part["workers"]} == {"running"}


def test_progress_metrics_are_kept_per_attempt_and_shown_in_the_job_view(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    split = {"step_s": 0.5, "compute_s": 0.4, "comm_s": 0.1, "comm_bytes": 2.5e6, "lr": 3e-4}

    def progress(step: int, metrics: dict[str, float]) -> dict:
        return {"step": step, "loss": 2.0, "at": "2026-12-02T10:00:00Z", "metrics": metrics}

    a.status(sa, "running", workers=workers_for(sa, "running"), progress=progress(10, split))
    newer = {**split, "comm_s": 0.2, "step_s": 0.6}
    assert a.status(sa, "running", workers=workers_for(sa, "running"), progress=progress(20, newer)).status_code == 200
    a.status(sa, "running", workers=workers_for(sa, "running"), progress=progress(5, {"comm_s": 9.0}))  # late
    view = _job(client, job["id"])
    assert view["progress"]["step"] == 20
    assert view["progress"]["metrics"] == newer
    [attempt] = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["progress_metrics"] == view["progress"]["metrics"]
    # The measured split; without a model there is no predicted one.
    assert view["split"] == {"predicted": None, "step_ratio": None, "measured": {
        "step_s": 0.6, "compute_s": 0.4, "comm_s": 0.2, "comm_share": pytest.approx(1 / 3)}}


def test_delayed_heartbeat_is_ignored(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    a.heartbeat([sa["attempt_id"]])  # seq 2: processes still alive
    # A heartbeat built earlier (seq 1) arrives now claiming nothing runs: it must not release.
    a.heartbeat([], seq=1)
    assert len(_job(client, job["id"])["allocation"]) == 2
    a.heartbeat([])
    b.heartbeat([])
    assert _job(client, job["id"])["state"] == "cancelled"


def test_cancel_running_job_releases_only_after_processes_gone(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    for agent, spec in ((a, sa), (b, sb)):
        agent.status(spec, "running", workers=workers_for(spec, "running"))
    assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).json()["state"] == "cancelling"
    assert a.heartbeat([sa["attempt_id"]])["assignments"] == []
    b.heartbeat([sb["attempt_id"]])
    assert _job(client, job["id"])["state"] == "cancelling"
    a.heartbeat([])
    assert _job(client, job["id"])["state"] == "cancelling"
    b.heartbeat([])
    view = _job(client, job["id"])
    assert view["state"] == "cancelled" and view["allocation"] == []
    nodes = client.get("/v1/nodes", headers=ADMIN).json()
    assert all(g["job_id"] is None for n in nodes for g in n["gpus"])


def test_report_for_a_rank_the_node_does_not_hold_is_403(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes)
    r = a.status(sb, "running")
    assert r.status_code == 403


def test_old_exit_after_a_newer_attempt_started_moves_nothing_backwards(client, schedule, two_nodes):
    a, b = two_nodes
    job, (sa, sb) = _start(client, schedule, two_nodes, job_body(max_failures=2))
    b.status(sb, "exited", exit_code=1, workers=workers_for(sb, "exited", 1))
    a.heartbeat([])
    b.heartbeat([])
    assert schedule() == 1
    new = {agent.name: agent.heartbeat()["assignments"][0] for agent in (a, b)}
    for agent in (a, b):
        spec = new[agent.name]
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    before = _job(client, job["id"])
    assert before["state"] == "running" and before["current_attempt"]["number"] == 2

    # Attempt 1's messages, replayed and reordered: a success with a result, its failure again,
    # a heartbeat with an old sequence number, a worker event. All refused or ignored.
    ok = a.status(sa, "exited", exit_code=0, workers=workers_for(sa, "exited", 0), result={"weights_sha256": "x"})
    again = b.status(sb, "exited", exit_code=1, workers=workers_for(sb, "exited", 1))
    assert ok.status_code == again.status_code == 409
    event = client.post(f"/v1/agent/attempts/{sa['attempt_id']}/events", headers=a.headers, json={
        "fencing_token": sa["fencing_token"], "node_rank": sa["node_rank"],
        "events": [{"rank": 0, "kind": "checkpoint.restored", "message": "late", "data": {"step": 5}}]})
    assert event.status_code == 409
    a.heartbeat([], seq=1)
    after = _job(client, job["id"])
    assert after["state"] == "running" and after["result"] is None and after["failures"] == 1
    assert after["current_attempt"] == before["current_attempt"]
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert [(x["number"], x["outcome"], x["restored_from_step"]) for x in attempts] == [(1, "failed", None),
                                                                                        (2, None, None)]
    assert all(n["released_at"] is None for n in attempts[1]["nodes"])  # attempt 2 keeps its GPUs


def test_duplicated_worker_events_are_recorded_once(client, schedule, two_nodes):
    a, _b = two_nodes
    _job_view, (sa, _sb) = _start(client, schedule, two_nodes)
    body = {"fencing_token": sa["fencing_token"], "node_rank": sa["node_rank"],
            "events": [{"rank": 0, "kind": "checkpoint.restored", "message": "restored", "data": {"step": 40}}]}
    for _ in range(3):
        assert client.post(f"/v1/agent/attempts/{sa['attempt_id']}/events", headers=a.headers,
                           json=body).status_code == 200
    events = client.get(f"/v1/jobs/{sa['job_id']}/events", headers=ADMIN).json()["items"]
    assert [e["kind"] for e in events].count("checkpoint.restored") == 1
    attempt = client.get(f"/v1/jobs/{sa['job_id']}/attempts", headers=ADMIN).json()["items"][0]
    assert attempt["restored_from_step"] == 40
