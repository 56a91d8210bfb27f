"""The authorization matrix, built from the app's route table (issue 11, finding 5): every route
declares a policy (a route without one fails here), and every route is called as every kind of
caller: nobody, the bootstrap admin, an admin, an operator, a member and a viewer of tenant A, and
a node agent. A member or viewer of tenant B asking for tenant A's job gets 404, as for a job that
does not exist."""

from __future__ import annotations

import re
import uuid

import pytest
from fastapi.routing import APIRoute

from control_plane.api.deps import api_routes, other_routes, route_policy
from control_plane.authz import Role
from tests.control_plane.access import team
from tests.factories import ADMIN, FakeAgentSession, job_body, register_body

# Routes FastAPI adds itself (the OpenAPI document) and the static assets of the documentation pages,
# open to everyone.
FRAMEWORK_ROUTES = {"/openapi.json", "/static/swagger-ui", "/static/vendor"}


def test_every_route_declares_a_policy(app):
    routes = list(api_routes(app.routes))
    assert len(routes) >= 30
    missing = [f"{sorted(r.methods)} {r.path}" for r in routes if route_policy(r) is None]
    assert not missing, f"routes without a policy (declare one with api/deps.py Allow & co): {missing}"
    others = {getattr(r, "path", "") for r in other_routes(app.routes)}
    assert others <= FRAMEWORK_ROUTES, others - FRAMEWORK_ROUTES


@pytest.fixture
def world(client):
    agent = FakeAgentSession(client, "node-1", 2)
    a = team(client, "vision")
    b = team(client, "nlp")
    own = client.post("/v1/jobs", json=job_body(num_nodes=1, tenant="vision"), headers=ADMIN).json()
    spare = client.post("/v1/jobs", json=job_body(num_nodes=1, tenant="vision", name="spare"), headers=ADMIN).json()
    client.post("/v1/principals", json={"name": "throwaway", "tenant": "vision", "role": "viewer"}, headers=ADMIN)
    return {"agent": agent, "a": a, "b": b, "job": own["id"], "spare": spare["id"]}


def _path(route: APIRoute, world: dict, job: str) -> str:
    values = {"job_id": job, "node_id": world["agent"].node_id, "name": "throwaway", "sha256": "0" * 64,
              "token_id": str(uuid.uuid4()), "attempt_id": str(uuid.uuid4())}
    if route.path.startswith("/v1/tenants/"):
        values["name"] = "vision"
    return re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], route.path)


def _call(client, method: str, path: str, headers: dict[str, str]):
    body = register_body("node-new", 1) if path.endswith("/agent/register") else {}
    if path.endswith("/agent/wait"):
        body = {"timeout_s": 0.05}
    if path.endswith("/upload-slots"):  # a long poll too: its service checks the credential
        body = {"fencing_token": "x", "node_rank": 0, "rank": 0, "step": 1, "size_bytes": 1, "wait_s": 0}
    if path.endswith("/upload-slots/batch"):  # the same, for several ranks
        body = {"fencing_token": "x", "node_rank": 0, "wait_s": 0, "asks": [{"rank": 0, "step": 1, "size_bytes": 1}]}
    kwargs = {"json": body} if method in ("POST", "PUT", "PATCH") else {}
    return client.request(method, path, headers=headers, **kwargs)


def _routes(app) -> list[tuple[str, APIRoute]]:
    return sorted(((m, r) for r in api_routes(app.routes) for m in r.methods),
                  key=lambda mr: (mr[1].path.count("cancel"), mr[1].path, mr[0]))  # cancel last: it changes state


def test_every_role_on_every_route(app, client, world):
    a = world["a"]
    callers = {
        "anonymous": ({}, None),
        "bootstrap": (ADMIN, Role.admin),
        **{f"{role}": (c.headers, Role(role)) for role, c in a.items()},
        "node": (world["agent"].headers, "node"),
    }
    checked = 0
    for method, route in _routes(app):
        policy = route_policy(route)
        assert policy is not None
        for who, (headers, role) in callers.items():
            r = _call(client, method, _path(route, world, world["job"]), headers)
            where = f"{method} {route.path} as {who} ({policy.name})"
            if policy.credential == "none":
                allowed = True
            elif policy.credential == "node":
                allowed = role == "node"
            elif policy.credential == "join":
                allowed = False  # neither a principal's token nor a node's credential for another name
            else:
                allowed = isinstance(role, Role) and policy.allows(role)
            if allowed:
                assert r.status_code not in (401, 403), f"{where}: {r.status_code} {r.text}"
            elif role is None or not isinstance(role, Role) or policy.credential != "user":
                assert r.status_code == 401, f"{where}: {r.status_code} {r.text}"
                assert r.headers["content-type"].startswith("application/problem+json")
            else:
                assert r.status_code == 403, f"{where}: {r.status_code} {r.text}"
                assert r.headers["content-type"].startswith("application/problem+json")
            checked += 1
    assert checked >= 7 * 30


def test_another_tenants_job_is_404_to_members_and_viewers(app, client, world):
    b = world["b"]
    scoped = [(m, r) for m, r in _routes(app) if (p := route_policy(r)) is not None and p.tenant_scoped
              and "{job_id}" in r.path]
    assert len(scoped) >= 6  # get, cancel, attempts, checkpoints, events, logs
    for method, route in scoped:
        policy = route_policy(route)
        assert policy is not None
        for caller in (b["member"], b["viewer"]):
            r = _call(client, method, _path(route, world, world["job"]), caller.headers)
            where = f"{method} {route.path} as {caller.name}"
            if policy.allows(Role(caller.role)):
                assert r.status_code == 404, f"{where}: {r.status_code} {r.text}"
                assert "does not exist" in r.json()["detail"]
            else:
                assert r.status_code == 403, f"{where}: {r.status_code}"
        # Their own tenant's people see it (operators see every tenant's).
        for caller in (world["a"]["viewer"], b["operator"]):
            if policy.allows(Role(caller.role)) and method == "GET":
                r = _call(client, method, _path(route, world, world["job"]), caller.headers)
                assert r.status_code == 200, f"{method} {route.path} as {caller.name}: {r.text}"
    # Listings show a member only its tenant's jobs; the cluster view its tenant's queue.
    assert client.get("/v1/jobs", headers=b["member"].headers).json()["items"] == []
    assert {j["id"] for j in client.get("/v1/jobs", headers=world["a"]["viewer"].headers).json()["items"]} == {
        world["job"], world["spare"]}
    assert client.get("/v1/cluster", headers=b["viewer"].headers).json()["queue"] == []
    assert len(client.get("/v1/cluster", headers=b["operator"].headers).json()["queue"]) == 2
