"""Status reports of one job's nodes do not queue behind each other (issue 9), on real PostgreSQL.

A status report shares the job and attempt rows (fencing) and writes only its own node's part, its
workers and its progress; whatever it may change of the attempt or the job is settled after it
committed, under the exclusive locks (services/runs/status_reports.py ``apply_status``, ``settle``). Before,
every report locked the job row exclusively to write progress to it, so a job's 128 nodes reported
one at a time.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from datetime import UTC, datetime
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import text

from control_plane.models import Node
from control_plane.services.runs import status_reports
from tests.control_plane.helpers import get_job
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from tests.helpers import in_parallel
from trainyard.protocol.agent import AttemptStatusReport


def _start(client: TestClient, nodes: int) -> tuple[list[FakeAgentSession], list[dict[str, Any]], dict[str, Any]]:
    agents = [FakeAgentSession(client, f"node-{i}", 1) for i in range(nodes)]
    job = client.post("/v1/jobs", json=job_body(num_nodes=nodes, gpus_per_node=1, max_failures=1), headers=ADMIN).json()
    assert client.app.state.loops.schedule_once() == 1
    specs = [a.heartbeat()["assignments"][0] for a in agents]
    return agents, specs, job


def _progress(step: int, loss: float) -> dict[str, Any]:
    return {"step": step, "loss": loss, "at": datetime.now(UTC).isoformat()}


def _report(spec: dict[str, Any], state: str, **extra: Any) -> AttemptStatusReport:
    return AttemptStatusReport.model_validate({"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                                               "state": state, "workers": workers_for(spec, "running"), **extra})


def _blocked_by(factory: Any, pid: int) -> bool:
    with factory() as probe:
        return bool(probe.scalar(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                      "AND :pid = ANY(pg_blocking_pids(pid))"), {"pid": pid}))


def test_a_report_held_open_does_not_block_the_other_nodes_reports(client):
    agents, specs, job = _start(client, 4)
    for agent, spec in zip(agents, specs, strict=True):
        assert agent.status(spec, "running", workers=workers_for(spec, "running")).status_code == 200
    factory = client.app.state.session_factory
    held = factory()
    try:
        # Node 0's report, merged and not committed: its transaction holds what a report holds.
        node0 = held.get(Node, uuid.UUID(agents[0].node_id))
        status_reports.apply_status(held, node0, uuid.UUID(specs[0]["attempt_id"]),
                              _report(specs[0], "running", progress=_progress(7, 0.7)))
        holder = held.scalar(text("SELECT pg_backend_pid()"))
        done: list[int] = []

        def report(i: int) -> None:
            r = agents[i].status(specs[i], "running", workers=workers_for(specs[i], "running"),
                                 progress=_progress(10 + i, 1.0 / i))
            done.append(r.status_code)

        threads = [threading.Thread(target=report, args=(i,), daemon=True) for i in (1, 2, 3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        blocked = False
        while len(done) < 3 and time.monotonic() < deadline and not blocked:
            blocked = _blocked_by(factory, holder)
            time.sleep(0.05)
        assert not blocked, "a status report waited for another node's report of the same job"
        assert sorted(done) == [200, 200, 200]
        held.commit()
    finally:
        held.rollback()
        held.close()
    # The job's progress is its furthest node's; the attempt's too.
    view = get_job(client, job["id"])
    assert view["progress"]["step"] == 13 and view["progress"]["loss"] == 1.0 / 3
    [attempt] = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["progress_step"] == 13 and attempt["first_progress_at"] is not None


def _concurrently(client: TestClient, agents: list[FakeAgentSession], reports: list[AttemptStatusReport],
                  attempt_id: str) -> None:
    """The reports' first transactions all open at once, then committed, then settled (as the route)."""
    inside = threading.Barrier(len(reports))

    def send(i: int) -> None:
        session = client.app.state.session_factory()
        try:
            merged = status_reports.apply_status(session, session.get(Node, uuid.UUID(agents[i].node_id)),
                                           uuid.UUID(attempt_id), reports[i])
            with contextlib.suppress(threading.BrokenBarrierError):
                inside.wait(timeout=2.0)  # every report in its transaction, unless one waits for another
            session.commit()
            if merged.settle:
                status_reports.settle(session, uuid.UUID(attempt_id), reports[i].result)
                session.commit()
        finally:
            session.close()

    in_parallel(send, [(i,) for i in range(len(reports))], timeout=60)


def test_the_last_reports_arriving_at_once_still_decide_the_attempt(client):
    """Every worker running, then every node exiting 0: the reports completing either condition
    arrive together, each in a transaction that cannot see the others'; the later to commit sees
    them all and decides."""
    agents, specs, job = _start(client, 3)
    attempt_id = specs[0]["attempt_id"]
    _concurrently(client, agents, [_report(s, "running") for s in specs], attempt_id)
    assert get_job(client, job["id"])["state"] == "running"
    finals = [_report(s, "exited", exit_code=0, workers=workers_for(s, "exited", 0),
                      result={"loss": 0.1} if s["node_rank"] == 0 else None) for s in specs]
    _concurrently(client, agents, finals, attempt_id)
    view = get_job(client, job["id"])
    assert view["state"] == "succeeded" and view["result"] == {"loss": 0.1}


def test_a_final_report_that_says_no_process_is_left_releases_the_gpus(client):
    agents, specs, job = _start(client, 2)
    for agent, spec in zip(agents, specs, strict=True):
        agent.status(spec, "running", workers=workers_for(spec, "running"))
    # A rank fails on node 1; its agent has seen every process of it go.
    r = agents[1].status(specs[1], "exited", exit_code=1, workers=workers_for(specs[1], "exited", 1),
                         processes_alive=False)
    assert r.status_code == 200 and r.json() == {"attempt_state": "stopping", "stop": True, "released": True,
                                                  "checkpoint_interval_steps": None,  # not an 'auto' job
                                                  "handover_ok": False}
    nodes = {n["name"]: n for n in client.get("/v1/nodes", headers=ADMIN).json()}
    assert [g["attempt_id"] for g in nodes["node-1"]["gpus"]] == [None]  # free without a heartbeat
    assert [g["attempt_id"] for g in nodes["node-0"]["gpus"]] == [specs[0]["attempt_id"]]
    # Node 0 stops its workers: a final report without the fact leaves the release to its heartbeat.
    r = agents[0].status(specs[0], "stopped", workers=workers_for(specs[0], "exited", -15))
    assert r.status_code == 200 and r.json()["released"] is False
    assert get_job(client, job["id"])["leases_held"] == 1
    agents[0].heartbeat(alive=[])
    [attempt] = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["state"] == "ended" and all(n["released_at"] for n in attempt["nodes"])
    # The fact belongs to a final report only.
    r = agents[0].status(specs[0], "running", processes_alive=False)
    assert r.status_code == 422 and "final report" in r.json()["detail"]
