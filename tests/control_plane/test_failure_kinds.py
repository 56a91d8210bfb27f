"""Failures that explain themselves (issue 13): a worker whose script cannot start fails its job at
once (no retries) with the worker's own words in end_reason; other failures are classified on the
attempt and retried; progress carries total steps, a step rate and an ETA."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.control_plane.helpers import get_job, submit
from tests.factories import ADMIN, FakeAgentSession, workers_for


def _exit(agent: FakeAgentSession, spec: dict, cause: str, message: str) -> None:
    workers = workers_for(spec, "exited", 1)
    workers[0].update(cause=cause, message=message)
    r = agent.status(spec, "exited", exit_code=1, workers=workers)
    assert r.status_code == 200, r.text


def test_a_script_that_cannot_start_fails_its_job_at_once(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, max_failures=3)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    _exit(agent, spec, "start_error", "ModuleNotFoundError: No module named 'trian' (train.py line 3)")
    after = get_job(client, job["id"])
    assert after["state"] == "failed" and after["failures"] == 1
    assert "cannot start" in after["end_reason"] and "No module named 'trian'" in after["end_reason"]
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "start_error"
    worker = attempt["nodes"][0]["workers"][0]
    assert worker["cause"] == "start_error" and "trian" in worker["message"]


def test_other_failures_are_classified_and_retried(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, max_failures=3)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    _exit(agent, spec, "exception", "ValueError: lr must be positive (train.py line 9)")
    after = get_job(client, job["id"])
    assert after["state"] == "recovering" and after["failures"] == 1
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "exception"
    assert attempt["end_reason"] == ("rank 0 on node-1 exited with code 1: "
                                     "ValueError: lr must be positive (train.py line 9)")
    # A signal without a classification from the shim (an older agent) is still named.
    agent.heartbeat([])
    schedule()
    spec2 = next(s for s in agent.heartbeat()["assignments"] if s["attempt_id"] != spec["attempt_id"])
    agent.status(spec2, "exited", exit_code=1, workers=workers_for(spec2, "exited", -9))
    attempts = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempts[1]["failure_kind"] == "signal"


def test_progress_has_total_rate_eta_metrics_and_a_history(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    t = datetime.now(UTC)
    for i, step in enumerate((10, 20, 40)):
        agent.status(spec, "running", workers=workers_for(spec, "running"), progress={
            "step": step, "loss": 3.0 - i, "at": (t + timedelta(seconds=10 * i)).isoformat(), "total_steps": 240,
            "metrics": {"tokens_per_s": 1000.0 + i}})
    progress = get_job(client, job["id"])["progress"]
    # Rates 1/s then 2/s, smoothed with weight 0.3 on the newest: 1.3 steps/s; 200 steps to go.
    assert progress["total_steps"] == 240 and progress["step"] == 40
    assert abs(progress["steps_per_s"] - 1.3) < 1e-6 and abs(progress["eta_s"] - 200 / 1.3) < 0.1
    assert progress["metrics"] == {"tokens_per_s": 1002.0}
    history = client.get(f"/v1/jobs/{job['id']}/progress", headers=ADMIN).json()
    # The first report of the attempt is always sampled; the rest at most every SAMPLE_S of control-plane time.
    assert history["items"][0]["step"] == 10 and history["items"][0]["attempt_number"] == 1
    assert history["next_cursor"] is None


def test_a_peers_collective_error_waits_for_the_rank_that_failed_first(client, schedule):
    a, b = FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)
    job = submit(client, num_nodes=2, gpus_per_node=1)
    schedule()
    specs = {agent.name: agent.heartbeat()["assignments"][0] for agent in (a, b)}
    for agent in (a, b):
        spec = specs[agent.name]
        agent.status(spec, "running", workers=workers_for(spec, "running"))
    # node-1's rank lost its peer: a consequence. Its report arrives first; node-2 still runs.
    _exit(a, specs["node-1"], "collective_timeout", "RuntimeError: Connection closed by peer")
    assert get_job(client, job["id"])["state"] == "running"
    killed = workers_for(specs["node-2"], "exited", -9)
    killed[0].update(cause="signal", message="killed by SIGKILL")
    b.status(specs["node-2"], "exited", exit_code=1, workers=killed)
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "signal" and attempt["failed_node"] == "node-2"
    assert "killed by SIGKILL" in attempt["end_reason"]
    # /metrics counts failed attempts by that cause.
    assert 'trainyard_attempts_failed_total{cause="signal"} 1.0' in client.get("/metrics", headers=ADMIN).text


def test_collective_errors_everywhere_are_decided_at_once(client, schedule):
    a, b = FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)
    job = submit(client, num_nodes=2, gpus_per_node=1)
    schedule()
    specs = {agent.name: agent.heartbeat()["assignments"][0] for agent in (a, b)}
    _exit(b, specs["node-2"], "collective_timeout", "RuntimeError: Timed out waiting 300000ms for recv operation")
    _exit(a, specs["node-1"], "collective_timeout", "RuntimeError: Timed out waiting 300000ms for recv operation")
    after = get_job(client, job["id"])
    assert after["state"] == "recovering"  # nothing more will come: decided now, not stuck
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "collective_timeout"


def test_a_long_history_is_charted_from_evenly_spread_samples(app, client, schedule):
    from sqlalchemy import insert

    from control_plane.db import session_scope
    from control_plane.models import ProgressSample
    from control_plane.services.runs import progress

    FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1)
    t = datetime.now(UTC)
    with session_scope(app.state.session_factory) as s:
        s.execute(insert(ProgressSample), [{"job_id": job["id"], "attempt_number": 1, "step": i, "loss": 1.0,
                                            "at": t + timedelta(seconds=i)} for i in range(1, 2501)])
    with session_scope(app.state.session_factory) as s:
        steps = [r.step for r in progress.chart_samples(s, job["id"], points=500)]
    assert steps[0] == 1 and steps[-1] == 2500 and 400 <= len(steps) <= 502
    gaps = {b - a for a, b in zip(steps, steps[1:-1], strict=False)}
    assert gaps == {5}  # evenly spread


def test_a_part_whose_shim_was_killed_is_a_signal_by_torchruns_account(client, schedule):
    agent = FakeAgentSession(client, "node-1", 1)
    job = submit(client, num_nodes=1, gpus_per_node=1)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    agent.status(spec, "running", workers=workers_for(spec, "running"))
    # The rank's shim died with it: no exit recorded for the worker; torchrun's own words say -9.
    agent.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited"),
                 error="torchrun exited with 1: ...] failed (exitcode: -9) local_rank: 0 (pid: 15824) of binary")
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "signal" and "exitcode: -9" in attempt["end_reason"]


# --- issue 26: a job's own exception is its own, and one that comes back at the same step ends it ---

def _next_attempt(agent: FakeAgentSession, schedule, before: dict) -> dict:
    """The processes of ``before`` are gone (the agent lists none), a pass schedules the recovery."""
    agent.heartbeat([])
    schedule()
    return next(s for s in agent.heartbeat()["assignments"] if s["attempt_id"] != before["attempt_id"])


def test_the_same_exception_at_the_same_step_twice_fails_the_job_with_a_reason_that_says_so(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, max_failures=5)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    said = "ValueError: bad batch (train.py line 9) in step 5"
    _exit(agent, spec, "exception", said)
    assert get_job(client, job["id"])["state"] == "recovering"
    spec = _next_attempt(agent, schedule, spec)
    _exit(agent, spec, "exception", said)
    after = get_job(client, job["id"])
    assert after["state"] == "failed" and after["failures"] == 2
    assert "same exception at the same step as attempt 1, so it is not retried" in after["end_reason"]
    assert "rank 0 on node-1 exited with code 1: " + said in after["end_reason"]


def test_the_same_exception_is_retried_at_another_step_or_when_the_job_asks(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, max_failures=5)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    _exit(agent, spec, "exception", "ValueError: bad batch (train.py line 9) in step 5")
    spec = _next_attempt(agent, schedule, spec)
    _exit(agent, spec, "exception", "ValueError: bad batch (train.py line 9) in step 7")
    assert get_job(client, job["id"])["state"] == "recovering"
    # Without a step (not a TrainLoop) nothing says it would come back: retried.
    spec = _next_attempt(agent, schedule, spec)
    _exit(agent, spec, "exception", "ValueError: bad batch (train.py line 9)")
    spec = _next_attempt(agent, schedule, spec)
    _exit(agent, spec, "exception", "ValueError: bad batch (train.py line 9)")
    assert get_job(client, job["id"])["state"] == "recovering"

    other = submit(client, name="retries", num_nodes=1, max_failures=5, retry_same_exception=True)
    assert get_job(client, other["id"])["retry_same_exception"] is True
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    agent.heartbeat([])
    schedule()
    spec = next(s for s in agent.heartbeat()["assignments"] if s["job_id"] == other["id"])
    for _ in range(2):
        _exit(agent, spec, "exception", "ValueError: bad batch (train.py line 9) in step 5")
        assert get_job(client, other["id"])["state"] == "recovering"
        spec = _next_attempt(agent, schedule, spec)


def test_a_jobs_own_exceptions_never_make_it_avoid_its_only_node_but_signals_do(client, schedule):
    agent = FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1, max_failures=3)
    schedule()
    (spec,) = agent.heartbeat()["assignments"]
    for step in (5, 6, 7):  # three different exceptions: each retried on the one node there is
        _exit(agent, spec, "exception", f"ValueError: bad batch (train.py line 9) in step {step}")
        assert get_job(client, job["id"])["state"] == "recovering"
        spec = _next_attempt(agent, schedule, spec)
    assert spec["job_id"] == job["id"]

    killed = submit(client, name="killed", num_nodes=1, max_failures=3)
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    agent.heartbeat([])
    schedule()
    spec = next(s for s in agent.heartbeat()["assignments"] if s["job_id"] == killed["id"])
    for _ in range(2):
        _exit(agent, spec, "signal", "killed by SIGKILL (the kernel's OOM killer, or an operator)")
        agent.heartbeat([])
        schedule()
        assignments = [s for s in agent.heartbeat()["assignments"] if s["attempt_id"] != spec["attempt_id"]]
        spec = assignments[0] if assignments else spec
    after = get_job(client, killed["id"])
    assert after["state"] == "failed" and "without node-1, which failed it twice" in after["end_reason"]


def test_a_part_stopped_at_its_resource_limit_names_the_limit_not_its_killed_worker(client, schedule):
    """A memory hog's worker is killed by the kernel (SIGKILL) and its agent stops the part at its
    cgroup limit, reporting both at once: the attempt's reason is the limit (resource_limit, the job's
    own failure: never counted against the node), not 'killed by SIGKILL'."""
    a, b = FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)
    job = submit(client, num_nodes=2, gpus_per_node=1, max_failures=0)
    schedule()
    specs = {agent.name: agent.heartbeat()["assignments"][0] for agent in (a, b)}
    for agent in (a, b):
        agent.status(specs[agent.name], "running", workers=workers_for(specs[agent.name], "running"))
    killed = workers_for(specs["node-2"], "exited", -9)
    killed[0].update(cause="signal", message="killed by SIGKILL (the kernel's OOM killer, or an operator)")
    limit = "out of memory: cgroup limit 2 GiB (the kernel killed 1 process of the part)"
    r = b.status(specs["node-2"], "exited", exit_code=1, workers=killed, error=limit, error_kind="resource_limit")
    assert r.status_code == 200, r.text
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failure_kind"] == "resource_limit" and attempt["failed_node"] == "node-2", attempt
    assert limit in attempt["end_reason"] and "SIGKILL" not in attempt["end_reason"]
    assert limit in get_job(client, job["id"])["end_reason"]


def _two_running(client, schedule) -> tuple[dict, FakeAgentSession, FakeAgentSession, dict]:
    a, b = FakeAgentSession(client, "node-1", 1), FakeAgentSession(client, "node-2", 1)
    job = submit(client, num_nodes=2, gpus_per_node=1)
    schedule()
    specs = {agent.name: agent.heartbeat()["assignments"][0] for agent in (a, b)}
    for agent in (a, b):
        agent.status(specs[agent.name], "running", workers=workers_for(specs[agent.name], "running"))
    return job, a, b, specs


def _shift(app, **updates: object) -> None:
    from sqlalchemy import update

    from control_plane.db import session_scope
    from control_plane.models import Node, Worker

    with session_scope(app.state.session_factory) as s:
        if "heartbeat_of" in updates:
            s.execute(update(Node).where(Node.name == updates["heartbeat_of"])
                      .values(last_heartbeat_at=datetime.now(UTC) - timedelta(seconds=float(updates["ago_s"]))))
        if "ended_ago_s" in updates:
            s.execute(update(Worker).where(Worker.exit_code == 1)
                      .values(ended_at=datetime.now(UTC) - timedelta(seconds=float(updates["ended_ago_s"]))))


def _sweep(app, silence=None) -> int:
    """The monitor loop's sweep of undecided failures (scheduler/loops.py, _settle_undecided)."""
    from control_plane.db import session_scope
    from control_plane.services.runs import status_reports

    silence = silence or status_reports.Silence(interval_s=1.0)
    decided = 0
    with session_scope(app.state.session_factory) as s:
        ids = status_reports.undecided(s)
    for attempt_id in ids:
        with session_scope(app.state.session_factory) as s:
            attempt = status_reports.settle(s, attempt_id, silence=silence)
            decided += attempt is not None and attempt.outcome is not None
    return decided


def test_a_peers_collective_error_blames_a_node_that_went_silent(app, client, schedule):
    """Issue 30: a node that died with its agent never reports its rank's death; its peer's collective
    error is decided by the monitor's next sweep with the silent node blamed (the next attempt is
    placed without it), not after the node-lost timeout. A status report alone never blames a
    silent node, nor does the sweep during the control plane's start-up grace."""
    from control_plane.services.runs import status_reports

    job, a, _b, specs = _two_running(client, schedule)
    _shift(app, heartbeat_of="node-2", ago_s=2.5)  # two of its 1 s heartbeats missed
    _exit(a, specs["node-1"], "collective_timeout", "RuntimeError: Connection closed by peer")
    assert get_job(client, job["id"])["state"] == "running"  # the report waits for the cause's
    grace = status_reports.Silence(interval_s=1.0, not_before=datetime.now(UTC) + timedelta(seconds=60))
    assert _sweep(app, grace) == 0 and get_job(client, job["id"])["state"] == "running"
    assert _sweep(app, status_reports.Silence(interval_s=5.0)) == 0  # 2.5 s is not two 5 s intervals
    assert _sweep(app) == 1
    assert get_job(client, job["id"])["state"] == "recovering"
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failed_node"] == "node-2" and attempt["failure_kind"] == "node_lost"
    assert "node rank 1 on node-2 went silent" in attempt["end_reason"]


def test_a_failure_left_waiting_for_its_cause_is_decided_by_the_monitor_when_nothing_comes(app, client, schedule):
    """The peer's report ended its part; the cause's node neither reports nor goes silent in time:
    the monitor's sweep decides once the grace is over (no later report would), blaming the rank
    that failed first."""
    from control_plane.services.runs import status_reports

    job, a, _b, specs = _two_running(client, schedule)
    _exit(a, specs["node-1"], "collective_timeout", "RuntimeError: Connection closed by peer")
    assert _sweep(app) == 0  # within the grace, node-2 heard from: still waiting
    assert get_job(client, job["id"])["state"] == "running"
    _shift(app, ended_ago_s=status_reports.CONSEQUENCE_GRACE_S + 1)
    assert _sweep(app) == 1
    assert get_job(client, job["id"])["state"] == "recovering"
    (attempt,) = client.get(f"/v1/jobs/{job['id']}/attempts", headers=ADMIN).json()["items"]
    assert attempt["failed_node"] == "node-1" and attempt["failure_kind"] == "collective_timeout"
