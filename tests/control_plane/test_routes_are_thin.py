"""Routes are thin (issue 9, design: "services own their commits; routes never commit; scheduler
wake-ups go through one dependency"). A source scan of control_plane/api: no route module commits,
reads ``app.state``, runs SQL or reaches the scheduler; api/deps.py, the one place that hands out
the session and the runtime (``RuntimeDep``) and ends transactions in the endpoint's thread
(``TransactionRoute``), is the exception."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

from fastapi import Request

from control_plane.api.deps import Runtime, get_runtime
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for

API = Path(__file__).resolve().parents[2] / "control_plane" / "api"
ROUTES = sorted(p for p in API.glob("*.py") if p.name not in ("deps.py", "__init__.py"))


def _offences(source: str, name: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "commit", "rollback", "schedule_once"):
            found.append(f"{where} calls .{node.func.attr}()")
        if isinstance(node, ast.Attribute) and node.attr == "state" and (
                isinstance(node.value, ast.Attribute) and node.value.attr == "app"):
            found.append(f"{where} reads app.state")
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[0] == "sqlalchemy" or node.module.startswith("control_plane.scheduler")):
            found.append(f"{where} imports {node.module}")
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] == "sqlalchemy" or a.name.startswith("control_plane.scheduler")]
    return found


def test_the_scan_sees_route_modules():
    assert {p.name for p in ROUTES} >= {"agent.py", "jobs.py", "nodes.py", "tenants.py", "health.py"}


def test_no_route_commits_reads_app_state_or_schedules():
    offences = [o for path in ROUTES for o in _offences(path.read_text(), path.name)]
    assert offences == [], "routes parse, call one service and return a schema (STYLE.md 1):\n" + "\n".join(offences)


def test_the_scan_catches_the_old_routes():
    """The scan is not vacuous: each route shape it forbids is found."""
    old = ("from sqlalchemy import text\n"
           "def route(session, request):\n"
           "    request.app.state.wake_scheduler()\n"
           "    session.commit()\n"
           "    request.app.state.loops.schedule_once()\n")
    assert sorted(o.split(" ", 1)[1] for o in _offences(old, "old.py")) == [
        "calls .commit()", "calls .schedule_once()", "imports sqlalchemy", "reads app.state", "reads app.state"]


def test_a_heartbeat_that_frees_the_gpus_answers_with_the_pass_result(app, client):
    """The heartbeat that releases the last GPUs a waiting job needs runs a scheduling pass at once
    (services/agent_protocol.heartbeat_and_schedule, through the RuntimeDep wake-ups) and carries
    the new attempt in its own answer, not a heartbeat later."""
    passes: list[int] = []

    def runtime(request: Request) -> Runtime:  # as in a process that runs the loops (the tests' settings do not)
        rt = replace(get_runtime(request), run_loops=True)
        schedule_once = rt.loops.schedule_once

        class Loops:
            wake_scheduler = rt.loops.wake_scheduler

            def schedule_once(self) -> int:
                passes.append(1)
                return schedule_once()

        return replace(rt, loops=Loops())

    app.dependency_overrides[get_runtime] = runtime
    a, b = FakeAgentSession(client, "node-1"), FakeAgentSession(client, "node-2")
    first = client.post("/v1/jobs", json=job_body(), headers=ADMIN).json()
    assert app.state.loops.schedule_once() == 1
    specs = [agent.heartbeat()["assignments"][0] for agent in (a, b)]
    second = client.post("/v1/jobs", json=job_body(name="second"), headers=ADMIN).json()
    for agent, spec in zip((a, b), specs, strict=True):
        agent.status(spec, "exited", exit_code=0, workers=workers_for(spec, "exited", 0), result={"ok": True})
    assert client.get(f"/v1/jobs/{first['id']}", headers=ADMIN).json()["state"] == "succeeded"
    assert a.heartbeat([])["assignments"] == []  # half the gang's GPUs: nothing fits yet
    answer = b.heartbeat([])  # the last ones: the pass runs in this request
    assert [s["job_id"] for s in answer["assignments"]] == [second["id"]]
    assert len(passes) == 1  # only the heartbeat that ended the attempt (its whole gang free) ran one
    assert client.get(f"/v1/jobs/{second['id']}", headers=ADMIN).json()["state"] == "starting"
