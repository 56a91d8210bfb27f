"""Watchdogs, the auto checkpoint interval, goodput in the views, /metrics and POST /v1/simulations,
over the agent protocol against real PostgreSQL with the control plane's clock moved by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from control_plane.settings import Settings
from tests.factories import ADMIN, ADMIN_TOKEN, JOIN_TOKEN, FakeAgentSession, job_body, workers_for


@pytest.fixture
def settings(fresh_database_url: str) -> Settings:
    return Settings(database_url=fresh_database_url, admin_token=ADMIN_TOKEN, join_token=JOIN_TOKEN, run_loops=False,
                    log_json=False, startup_grace_s=0, node_lost_timeout_s=2, hang_timeout_min_s=30,
                    straggler_persist_s=5, metrics_cache_s=0, metrics_token="scrape-me",
                    startup_timeout_s=60)


@pytest.fixture
def running(clock, app, client, schedule):
    """A 2 x 2 job running on node-1 and node-2; returns (job, specs by node name, agents)."""
    def start(**body: Any) -> tuple[dict, dict[str, dict], dict[str, FakeAgentSession]]:
        agents = {n: FakeAgentSession(client, n, 2) for n in ("node-1", "node-2")}
        job = client.post("/v1/jobs", json=job_body(num_nodes=2, gpus_per_node=2, **body), headers=ADMIN).json()
        assert schedule() == 1
        specs = {n: a.heartbeat()["assignments"][0] for n, a in agents.items()}
        for n, a in agents.items():
            assert a.status(specs[n], "running", workers=workers_for(specs[n], "running")).status_code == 200
        return job, specs, agents
    return start


def _ranks(spec: dict, *, step: int, silent: dict[int, float] | None = None, busy: dict[int, float] | None = None):
    base = spec["node_rank"] * spec["nproc_per_node"]
    return {"ranks": [{"rank": r, "step": step, "step_time_s": 0.1, "busy_s": (busy or {}).get(r, 0.05),
                       "silent_s": (silent or {}).get(r, 0.2), "stalled_s": 0.2}
                      for r in range(base, base + spec["nproc_per_node"])]}


def _report(agent, spec, step, **ranks: Any):
    progress = {"step": step, "loss": 1.0, "at": "2026-12-02T12:00:00Z"} if spec["node_rank"] == 0 else None
    r = agent.status(spec, "running", workers=workers_for(spec, "running"), progress=progress,
                     ranks=_ranks(spec, step=step, **ranks))
    assert r.status_code == 200, r.text
    return r.json()


def _events(client, job_id, kind):
    items = client.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000}, headers=ADMIN).json()["items"]
    return [e for e in items if e["kind"] == kind]


def test_a_silent_rank_fails_its_attempt_as_hung_and_the_job_recovers(clock, app, client, schedule, running):
    job, specs, agents = running()
    for step in (1, 11, 21):  # a step every 0.1 s: the derived timeout is the 30 s floor
        for n in agents:
            _report(agents[n], specs[n], step)
        clock.advance(1.0)
    assert app.state.loops.watchdog_once() == 0
    clock.advance(20)
    _report(agents["node-2"], specs["node-2"], 21, silent={3: 12.0})  # rank 3 stopped reporting
    assert app.state.loops.watchdog_once() == 0  # 21 s without a step: not yet
    clock.advance(10)
    _report(agents["node-1"], specs["node-1"], 21, silent={0: 1.0})  # blocked in a collective: still reports
    _report(agents["node-2"], specs["node-2"], 21, silent={3: 22.0})
    assert app.state.loops.watchdog_once() == 1
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["outcome"] == "failed" and attempt["failed_node"] == "node-2"
    assert attempt["end_reason"].startswith("hung: step 21 has not advanced for 31.0s (hang timeout 30s")
    assert "rank 3 on node-2 stopped reporting" in attempt["end_reason"] and attempt["hung_since"]
    (hung,) = _events(client, job["id"], "attempt.hung")
    assert hung["data"]["ranks"] == [3] and hung["data"]["timeout_s"] == 30
    view = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()
    assert view["state"] == "recovering"
    assert view["goodput"]["hung_s"] == pytest.approx(31.0) and view["goodput"]["hung_gpu_s"] == pytest.approx(124)
    for a in agents.values():  # the workers are stopped; their GPUs come back; the next attempt starts
        a.heartbeat([])
    assert schedule() == 1
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["current_attempt"]["number"] == 2


def test_a_rank_slower_than_its_peers_is_named_with_its_node(clock, app, client, running):
    job, specs, agents = running(watchdog={"straggler_factor": 2.0})
    for step in (10, 20, 30, 40):
        _report(agents["node-1"], specs["node-1"], step)
        _report(agents["node-2"], specs["node-2"], step, busy={3: 0.16})  # 3.2x the median
        app.state.loops.watchdog_once()
        clock.advance(2.0)
    (named,) = _events(client, job["id"], "attempt.straggler")
    assert (named["data"]["rank"], named["data"]["node"], named["data"]["factor"]) == (3, "node-2", 2.0)
    assert named["data"]["ratio"] == pytest.approx(3.2)
    (shown,) = client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["stragglers"]
    assert (shown["rank"], shown["node"], shown["ratio"]) == (3, "node-2", pytest.approx(3.2))
    _report(agents["node-2"], specs["node-2"], 50)  # back in step with its peers
    app.state.loops.watchdog_once()
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["stragglers"] == []
    assert len(_events(client, job["id"], "attempt.straggler")) == 1


def test_the_platform_sets_an_auto_interval_and_tells_the_workers(clock, app, client, running):
    job, specs, agents = running(checkpoint={"interval_steps": "auto", "first_interval_steps": 20})
    assert specs["node-1"]["checkpoint"]["auto_interval_steps"] == 20
    assert _report(agents["node-1"], specs["node-1"], 1)["checkpoint_interval_steps"] == 20
    clock.advance(1.0)
    for step in (11, 21, 31):
        _report(agents["node-1"], specs["node-1"], step)
        clock.advance(1.0)
    app.state.loops.watchdog_once()
    (chosen,) = _events(client, job["id"], "checkpoint.interval")
    data = chosen["data"]
    # The prior cost (10 s) and MTBF (5,000 node-hours over 2 nodes): sqrt(2 x 10 x 9e6) s at 0.1 s a step.
    assert not data["cost_measured"] and data["cost_s"] == 10 and data["job_mtbf_s"] == pytest.approx(9e6, rel=1e-4)
    assert data["interval_steps"] == round((2 * 10 * 9e6) ** 0.5 / data["step_time_s"])
    assert data["step_time_s"] == pytest.approx(0.1)
    assert _report(agents["node-1"], specs["node-1"], 31)["checkpoint_interval_steps"] == data["interval_steps"]
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["checkpoint_interval"]["interval_steps"] == \
        data["interval_steps"]
    app.state.loops.watchdog_once()  # nothing new measured: no new event
    assert len(_events(client, job["id"], "checkpoint.interval")) == 1
    r = client.post("/v1/jobs", json=job_body(checkpoint={"interval_steps": "sometimes"}), headers=ADMIN)
    assert r.status_code == 422 and "interval_steps" in r.text


def test_metrics_need_their_token_and_show_the_database(clock, app, client, running):
    running()
    assert client.get("/metrics").status_code == 401
    r = client.get("/metrics", headers={"Authorization": "Bearer scrape-me"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'trainyard_jobs{state="running"} 1.0' in text
    # Every state and every failure cause has its series, 0 included (issue 26 item 8).
    for state in ("queued", "recovering", "succeeded", "failed", "cancelled"):
        assert f'trainyard_jobs{{state="{state}"}} 0.0' in text, state
    for cause in ("hung", "exception", "signal", "out_of_memory", "node_lost", "start_error"):
        assert f'trainyard_attempts_failed_total{{cause="{cause}"}} 0.0' in text, cause
    assert 'trainyard_nodes{state="lost"} 0.0' in text
    assert 'trainyard_gpu_leases{state="active"} 4.0' in text
    for name in ("trainyard_goodput_gpu_seconds{component=\"allocated\"}", "trainyard_goodput_ratio",
                 "trainyard_heartbeat_duration_seconds_bucket", "trainyard_queue_wait_seconds_bucket",
                 "trainyard_reservation_idle_gpu_seconds", "trainyard_queue_length"):
        assert name in text, name
    assert client.get("/metrics", headers=ADMIN).status_code == 200  # the admin token is good too
    # The shipped dashboard asks only for series this endpoint exposes.
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/trainyard.json").read_text())
    def family(name: str) -> str:
        return re.sub(r"_(bucket|count|sum|total)$", "", name)

    wanted = {family(m) for p in dashboard["panels"] for t in p["targets"]
              for m in re.findall(r"trainyard_\w+", t["expr"])}
    exposed = {family(m) for m in re.findall(r"^# TYPE (trainyard_\w+)", text, re.MULTILINE)}
    assert wanted and wanted <= exposed, wanted - exposed
    cluster = client.get("/v1/cluster", headers=ADMIN).json()
    assert cluster["goodput"]["jobs"] == 1 and cluster["goodput"]["allocated_gpu_s"] >= 0


def test_simulations_answer_and_refuse_clearly(client):
    body = {"nodes": 64, "node_mtbf_h": 1000, "work_h": 100, "blocking_s": 5, "background_s": 60,
            "sync_blocking_s": 60, "recovery_s": 300, "runs": 2}
    r = client.post("/v1/simulations", json=body, headers=ADMIN)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["young_interval_s"] == pytest.approx((2 * 5 * 1000 * 3600 / 64) ** 0.5, abs=0.1)
    assert {m["mode"] for m in out["modes"]} == {"async", "sync"} and 0 < out["goodput"] <= 1
    assert [s["spares"] for s in out["spares"]][-1] is None
    assert client.post("/v1/simulations", json=body).status_code == 401
    # A save that costs next to nothing: Young's interval rounds to 0 (it was a 500).
    tiny = client.post("/v1/simulations", json={**body, "blocking_s": 1e-300, "background_s": 0, "runs": 1},
                       headers=ADMIN)
    assert tiny.status_code in (200, 422) and tiny.headers["content-type"] != "text/plain", tiny.text
    for bad in ({**body, "nodes": 0}, {k: v for k, v in body.items() if k != "node_mtbf_h"},
                {**body, "node_mtbf_h": 0.001, "work_h": 100_000},
                # Saves a day apart on a job failing hourly: it would need e^100 tries to finish, and
                # the simulation ran for good (schemathesis found it holding a request thread).
                {**body, "nodes": 1, "node_mtbf_h": 1, "interval_s": 86_400, "recovery_s": 0}):
        r = client.post("/v1/simulations", json=bad, headers=ADMIN)
        assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text


def test_trainyard_simulate_prints_the_tables_and_fails_in_one_line(capsys):
    from trainyard.cli import main

    args = ["simulate", "--nodes", "64", "--node-mtbf-h", "1000", "--work-h", "50", "--blocking-s", "5",
            "--background-s", "60", "--runs", "2"]
    with pytest.raises(SystemExit) as done:
        main(args)
    out = capsys.readouterr().out
    assert done.value.code == 0 and "goodput by spare nodes" in out and "async against sync" in out
    with pytest.raises(SystemExit) as done:
        main([*args, "--json"])
    assert done.value.code == 0 and json.loads(capsys.readouterr().out)["modes"][0]["mode"] == "async"
    with pytest.raises(SystemExit) as done:
        main(["simulate", "--nodes", "64", "--blocking-s", "5"])
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.count("\n") == 1 and "node_mtbf_h" in err


def test_the_next_recovery_avoids_a_straggler_when_the_job_asks(clock, app, client, schedule):
    agents = {n: FakeAgentSession(client, n, 2) for n in ("node-1", "node-2", "node-3")}
    body = job_body(num_nodes=2, gpus_per_node=2, watchdog={"avoid_stragglers": True})
    job = client.post("/v1/jobs", json=body, headers=ADMIN).json()
    assert schedule() == 1
    specs = {n: s for n, a in agents.items() for s in a.heartbeat()["assignments"]}
    for n, spec in specs.items():
        agents[n].status(spec, "running", workers=workers_for(spec, "running"))
    slow_node = next(n for n, s in specs.items() if s["node_rank"] == 1)
    slow_rank = specs[slow_node]["nproc_per_node"]  # the first rank of node rank 1
    for step in (10, 20, 30, 40):
        for n, spec in specs.items():
            _report(agents[n], spec, step, busy={slow_rank: 0.2} if n == slow_node else None)
        app.state.loops.watchdog_once()
        clock.advance(2.0)
    assert _events(client, job["id"], "attempt.straggler")
    healthy = next(n for n in specs if n != slow_node)
    code = agents[healthy].status(specs[healthy], "exited", exit_code=1,
                                  workers=workers_for(specs[healthy], "exited", 1))
    assert code.status_code == 200
    for a in agents.values():
        a.heartbeat([])
    assert schedule() == 1
    placed = {n for n, a in agents.items() for s in a.heartbeat()["assignments"] if s["job_id"] == job["id"]}
    assert slow_node not in placed and len(placed) == 2


# --- issue 24: an attempt that never reports a first step ---

def _log(agent, spec, rank: int, offset: int, data: str) -> None:
    body = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
            "chunks": [{"rank": rank, "stream": "stderr", "offset": offset, "data": data}]}
    r = agent.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/logs", json=body, headers=agent.headers)
    assert r.status_code == 200, r.text


def test_an_attempt_without_a_first_step_fails_after_the_startup_timeout_quoting_each_ranks_stderr(
        clock, app, client, schedule, running):
    job, specs, agents = running()
    # What each rank of a confined DataLoader job wrote before it sat still (issue 24).
    for n, spec in specs.items():
        base = spec["node_rank"] * spec["nproc_per_node"]
        for rank in range(base, base + spec["nproc_per_node"]):
            _log(agents[n], spec, rank, 0, "Traceback (most recent call last):\n  File \"train.py\", line 40\n")
            _log(agents[n], spec, rank, 40, "OSError: AF_UNIX path too long\n")
    for n in agents:  # every rank keeps reporting, with no step
        agents[n].status(specs[n], "running", workers=workers_for(specs[n], "running"))
    clock.advance(59)
    assert app.state.loops.watchdog_once() == 0  # within the startup timeout
    clock.advance(2)
    assert app.state.loops.watchdog_once() == 1
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["outcome"] == "failed" and attempt["hung_since"]  # its time since the start counts as hung
    reason = attempt["end_reason"]
    assert reason.startswith("not started: no rank reported a first step 61s after every worker was running "
                             "(startup timeout 60s"), reason
    for rank in range(4):
        assert f"rank {rank}] Traceback (most recent call last): | File \"train.py\", line 40 | OSError: AF_UNIX " \
               "path too long" in reason, reason
    (event,) = _events(client, job["id"], "attempt.not_started")
    assert event["data"]["timeout_s"] == 60
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).json()["state"] == "recovering"
    assert app.state.loops.watchdog_once() == 0  # decided once


def test_an_attempt_that_took_a_step_is_the_hang_watchdogs_even_without_a_step_time(
        clock, app, client, running):
    job, specs, agents = running()
    for n in agents:  # one step, so no step time of its own yet: the hang floor (30 s) applies
        _report(agents[n], specs[n], 1)
    clock.advance(100)  # past the startup timeout: a step was seen, so it is not "not started"
    assert app.state.loops.watchdog_once() == 1
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["end_reason"].startswith("hung: step 1 has not advanced for 100.0s (hang timeout 30s"), attempt
    assert _events(client, job["id"], "attempt.not_started") == []


def test_an_attempt_at_its_last_step_is_given_time_to_finish_not_failed_as_hung(clock, app, client, running):
    """After its last step an attempt uploads its last checkpoint, sends its result and exits: no step
    advances any more, which is not a hang (the e2e watchdog test's second attempt was failed as hung
    at step 240 of 240 on a loaded machine); a frozen end is still caught, at FINISHING_TIMEOUT_S."""
    from control_plane.services.runs.watchdog import FINISHING_TIMEOUT_S

    job, specs, agents = running()
    for step in (90, 100):
        for n in agents:
            agents[n].status(specs[n], "running", workers=workers_for(specs[n], "running"), progress={
                "step": step, "loss": 1.0, "at": "2026-12-02T12:00:00Z", "total_steps": 100},
                ranks=_ranks(specs[n], step=step))
        clock.advance(1.0)
    clock.advance(40)  # past the 30 s floor: an attempt in mid-run would be hung by now
    assert app.state.loops.watchdog_once() == 0
    clock.advance(FINISHING_TIMEOUT_S)
    assert app.state.loops.watchdog_once() == 1
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["end_reason"].startswith("hung: step 100 has not advanced")
