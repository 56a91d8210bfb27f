"""The job commands of the CLI against a real control plane (uvicorn, real PostgreSQL) and an agent
speaking the real protocol (issue 13): login stores the URL and token 0600; run submits a YAML
job file; ps shows state, step of total, rate, ETA, GPUs; describe shows the attempt timeline,
allocation and events; logs (also followed) and cancel find jobs by name or id; nodes cordon and
uncordon; tenants; every failure is one line."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from control_plane.app import create_app
from tests.control_plane.helpers import serve
from tests.factories import ADMIN_TOKEN, FakeAgentSession, workers_for
from trainyard.cli import main

JOB_YAML = """\
# The submit body of POST /v1/jobs, as YAML
name: demo
num_nodes: 1
gpus_per_node: 2
entrypoint: worker_runtime.examples.tiny_gpt
args: ["--steps", "100"]
checkpoint: {interval_steps: 10}
"""


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(args)
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_login_run_ps_describe_logs_cancel_nodes_tenants(settings, tmp_path, monkeypatch, capsys):
    app = create_app(settings)
    config = tmp_path / "config" / "trainyard.json"
    monkeypatch.setenv("TRAINYARD_CONFIG", str(config))
    for name in ("TRAINYARD_TOKEN", "TRAINYARD_URL", "TRAINYARD_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    token_file = tmp_path / "admin.token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    with serve(app) as url, httpx.Client(base_url=url) as http:
        code, out, err = _run(["login", url, "--token-file", str(token_file)], capsys)
        assert code == 0 and "as admin" in err, err
        assert stat.S_IMODE(config.stat().st_mode) == 0o600 and ADMIN_TOKEN in config.read_text()
        agent = FakeAgentSession(http, "node-1", 2)  # type: ignore[arg-type]

        spec_file = tmp_path / "job.yaml"
        spec_file.write_text(JOB_YAML)
        code, out, err = _run(["run", str(spec_file)], capsys)
        assert code == 0, err
        job_id = out.strip()
        assert "demo" in err and "queued" in err

        app.state.loops.schedule_once()
        (spec,) = agent.heartbeat()["assignments"]
        t = datetime.now(UTC)
        for step, at in ((10, t), (30, t + timedelta(seconds=4))):
            r = agent.status(spec, "running", workers=workers_for(spec, "running"), progress={
                "step": step, "loss": 2.5, "at": at.isoformat(), "total_steps": 100, "metrics": {"lr": 0.001}})
            assert r.status_code == 200, r.text
        r = http.post(f"/v1/agent/attempts/{spec['attempt_id']}/logs", headers=agent.headers, json={
            "fencing_token": spec["fencing_token"], "node_rank": 0, "chunks": [
                {"rank": 0, "stream": "stdout", "offset": 0, "data": "step 10 loss 2.5\nstep 30 loss 2.5\n"},
                {"rank": 1, "stream": "stdout", "offset": 0, "data": "rank one says hi\n"}]})
        assert r.status_code == 200, r.text

        code, out, err = _run(["ps"], capsys)
        assert code == 0, err
        row = next(line for line in out.splitlines() if "demo" in line)
        # 20 steps in 4 s: 5.00/s, and 70 steps to go: 14 s.
        assert job_id[:8] in row and "running" in row and "30/100" in row and "5.00/s" in row and "14s" in row
        assert "1x2" in row

        code, out, err = _run(["describe", "demo"], capsys)
        assert code == 0, err
        assert "30/100" in out and "node-1 (rank 0) GPUs [0, 1]" in out and "lr 0.001" in out
        assert "#1 " in out and "attempt.allocated" in out

        code, out, err = _run(["logs", job_id[:8], "--rank", "1"], capsys)
        assert code == 0 and "rank one says hi" in out and "step 10" not in out, out

        code, out, err = _run(["nodes"], capsys)
        assert code == 0 and "node-1" in out and "ready" in out
        code, out, err = _run(["nodes", "cordon", "node-1"], capsys)
        assert code == 0 and "cordoned" in err
        code, out, err = _run(["nodes", "uncordon", "node-1"], capsys)
        assert code == 0 and "schedulable" in err
        code, out, err = _run(["nodes", "drain", "node-1"], capsys)
        assert code == 0 and "draining" in err  # its job still runs
        _run(["nodes", "uncordon", "node-1"], capsys)
        code, out, err = _run(["tenants", "set", "vision", "--weight", "2", "--gpu-quota", "8"], capsys)
        assert code == 0 and "weight 2.0, quota 8" in err
        code, out, err = _run(["tenants"], capsys)
        assert code == 0 and "default" in out and "vision" in out
        # Every listing: a table for people, the API's documents with --output json for scripts.
        for args, key in ((["ps"], "progress"), (["nodes"], "gpus"), (["tenants"], "weight")):
            code, out, err = _run([*args, "--output", "json"], capsys)
            assert code == 0 and isinstance(json.loads(out), list) and key in json.loads(out)[0], (args, out)

        code, out, err = _run(["cancel", "demo"], capsys)
        assert code == 0 and "cancelling" in err
        agent.status(spec, "stopped", exit_code=-15, workers=workers_for(spec, "exited", -15))
        agent.heartbeat([])
        # Following a job that ended prints its logs and its end, exit status 1 (it did not succeed).
        code, out, err = _run(["logs", "demo", "-f"], capsys)
        assert code == 1 and "step 30 loss 2.5" in out and "job demo cancelled" in err, (out, err)
        code, out, err = _run(["ps"], capsys)
        assert code == 0 and "demo" not in out
        code, out, err = _run(["ps", "--all", "--state", "cancelled"], capsys)
        assert "demo" in out

        # Failures: one line each.
        code, out, err = _run(["describe", "nope"], capsys)
        assert code == 1 and err == "trainyard: error: no job named 'nope' (nor with that id)\n"
        spec_file.write_text("name: demo\nnum_nodes: [1\n")
        code, out, err = _run(["run", str(spec_file)], capsys)
        assert code == 1 and "line 3 column 1" in err and len(err.splitlines()) == 1, err
        spec_file.write_text(JOB_YAML.replace("num_nodes: 1", "num_nodes: 0"))
        code, out, err = _run(["run", str(spec_file)], capsys)
        assert code == 1 and err.startswith("trainyard: error: 422: num_nodes:") and len(err.splitlines()) == 1, err
        (tmp_path / "code").mkdir()
        (tmp_path / "code" / "train.py").write_text("print('hi')\n")
        spec_file.write_text(JOB_YAML + "workdir: code\n")
        code, out, err = _run(["run", str(spec_file)], capsys)  # this control plane has no S3
        assert code == 1 and "code shipping needs S3" in err and len(err.splitlines()) == 1, err
        config.chmod(0o644)
        code, out, err = _run(["ps"], capsys)
        assert code == 1 and "readable by others" in err


def test_following_a_job_shows_its_failures_and_recoveries_and_ps_names_a_recovery(settings, tmp_path, monkeypatch,
                                                                                    capsys):
    # Issue 26: `logs -f` (and `run -f`, the same code) prints a line when an attempt fails, with its
    # cause, when a recovery starts and from which checkpoint step it resumes; `ps` says recovering.
    app = create_app(settings)
    monkeypatch.setenv("TRAINYARD_CONFIG", str(tmp_path / "trainyard.json"))
    monkeypatch.setenv("TRAINYARD_TOKEN", ADMIN_TOKEN)
    monkeypatch.delenv("TRAINYARD_TOKEN_FILE", raising=False)
    with serve(app) as url, httpx.Client(base_url=url) as http:
        monkeypatch.setenv("TRAINYARD_URL", url)
        agent = FakeAgentSession(http, "node-1", 2)  # type: ignore[arg-type]
        spec_file = tmp_path / "job.yaml"
        spec_file.write_text(JOB_YAML + "max_failures: 3\n")
        code, out, err = _run(["run", str(spec_file)], capsys)
        assert code == 0, err
        app.state.loops.schedule_once()
        (spec,) = agent.heartbeat()["assignments"]

        def fail(spec: dict, message: str) -> None:
            workers = workers_for(spec, "exited", 1)
            workers[0].update(cause="exception", message=message)
            assert agent.status(spec, "exited", exit_code=1, workers=workers).status_code == 200

        fail(spec, "ValueError: bad batch (train.py line 9) in step 15")
        agent.heartbeat([])
        app.state.loops.schedule_once()
        spec = next(s for s in agent.heartbeat()["assignments"] if s["attempt_id"] != spec["attempt_id"])
        code, out, err = _run(["ps"], capsys)
        row = next(line for line in out.splitlines() if "demo" in line)
        assert "recovering" in row and "starting" not in row, out
        assert "WAITING FOR" in out and "recovery (attempt 2): node node-1 to launch node rank 0" in out, out

        r = http.post(f"/v1/agent/attempts/{spec['attempt_id']}/events", headers=agent.headers, json={
            "fencing_token": spec["fencing_token"], "node_rank": 0,
            "events": [{"rank": 0, "kind": "checkpoint.restored", "message": "restored", "data": {"step": 10}}]})
        assert r.status_code == 200, r.text
        agent.status(spec, "running", workers=workers_for(spec, "running"))
        fail(spec, "ValueError: bad batch (train.py line 9) in step 15")  # again at step 15: not retried

        code, out, err = _run(["logs", "demo", "-f"], capsys)
        assert code == 1, err
        said = [line for line in err.splitlines() if line.startswith("trainyard: ")]
        assert said == [
            "trainyard: attempt 1 failed (rank 0 on node-1 exited with code 1: ValueError: bad batch (train.py "
            "line 9) in step 15); recovery 1 of 3",
            "trainyard: recovery: attempt 2 allocated 2 GPUs on 1 nodes",
            "trainyard: recovery: attempt 2 resumes from checkpoint step 10 (next step 11)",
            "trainyard: recovered: attempt 2: all 2 workers running",
        ], err
        assert "job demo failed" in err and "same exception at the same step as attempt 1" in err
