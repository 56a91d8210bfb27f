"""Routes are thin (issue 9, design: "services own their commits; routes never commit; scheduler
wake-ups go through one dependency"). A source scan of control_plane/api: no route module commits,
reads ``app.state``, runs SQL or reaches the scheduler; api/deps.py, the one place that hands out
the session and the runtime (``RuntimeDep``) and ends transactions in the endpoint's thread
(``TransactionRoute``), is the exception."""

from __future__ import annotations

import ast
from pathlib import Path

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
