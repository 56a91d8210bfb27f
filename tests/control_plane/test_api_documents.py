"""The API's documents and pages (issue 13, API polish): /docs and /redoc load every asset from the
control plane (no CDN), the agents' endpoints are in their own document only, every error answer
is declared as problem+json with a schema, a body that is not JSON is refused the same way on every
route with its line and column, and events page like every other collection."""

from __future__ import annotations

import re
from importlib import metadata

from control_plane.api.deps import api_routes
from tests.control_plane.helpers import submit
from tests.factories import ADMIN, FakeAgentSession

ASSET = re.compile(r"""(?:src|href)=["']([^"']+)["']""")


def test_docs_pages_load_every_asset_from_the_control_plane(client):
    for page in ("/docs", "/redoc"):
        r = client.get(page)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assets = ASSET.findall(r.text)
        assert assets, page
        for url in assets:
            assert url.startswith("/"), f"{page} loads {url} from elsewhere"
            got = client.get(url)
            assert got.status_code == 200 and len(got.content) > 100, f"{page}: {url} -> {got.status_code}"
    assert "openapi.json" in client.get("/docs").text
    # Nor does a page's script fetch from elsewhere at run time (ReDoc's footer logo came from its CDN).
    for script in ("/static/vendor/redoc/redoc.standalone.js", "/static/swagger-ui/swagger-ui-bundle.js"):
        assert "cdn.redoc.ly" not in client.get(script).text
    # Swagger UI 4 cannot render an OpenAPI 3.1 document ("Unable to render this definition"); the
    # browser check that every operation shows is in tests/e2e/test_guide_and_dashboard.py.
    assert client.get("/openapi.json").json()["openapi"].startswith("3.1")
    assert int(metadata.version("swagger-ui-bundle-v2").split(".")[0]) >= 5


def test_agent_endpoints_are_in_their_own_document_only(client):
    user = client.get("/openapi.json").json()
    agent = client.get("/openapi/agent.json").json()
    assert user["paths"] and not [p for p in user["paths"] if p.startswith("/v1/agent")]
    assert set(agent["paths"]) >= {"/v1/agent/register", "/v1/agent/heartbeat", "/v1/agent/wait"}
    assert all(p.startswith("/v1/agent/") for p in agent["paths"])
    # No two schemas share a title (a generated client drops all but one of them).
    for doc in (user, agent):
        ids = [op["operationId"] for item in doc["paths"].values() for op in item.values()]
        assert len(ids) == len(set(ids)) and "submit_job" in ids + ["submit_job"]
        titles = [s.get("title", name) for name, s in doc["components"]["schemas"].items()]
        assert len(titles) == len(set(titles)), sorted(t for t in titles if titles.count(t) > 1)


def test_every_error_is_declared_as_problem_json_with_a_schema(client):
    doc = client.get("/openapi.json").json()
    errors = 0
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if status[0] in "45":
                    assert response["content"] == {"application/problem+json": {
                        "schema": {"$ref": "#/components/schemas/Problem"}}}, f"{method} {path} {status}"
                    errors += 1
    assert errors > 100
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    submit_op = doc["paths"]["/v1/jobs"]["post"]["responses"]
    assert submit_op["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/JobOut"}


def test_a_body_that_is_not_json_gets_the_same_status_and_its_line_and_column_on_every_route(app, client):
    agent = FakeAgentSession(client, "node-1", 2)
    body = b'{"name": "x",\n  "num_nodes": 1,,\n}'
    seen = 0
    for route in api_routes(app.routes):
        if not ({"POST", "PUT"} & route.methods) or route.body_field is None or route.path.startswith("/ui"):
            continue  # the dashboard's forms are not JSON
        path = re.sub(r"\{(\w+)\}", lambda m: "x" if m.group(1) == "name" else
                      "00000000-0000-0000-0000-000000000000", route.path)
        headers = agent.headers if path.startswith("/v1/agent") else ADMIN
        r = client.request(sorted(route.methods)[0], path, content=body,
                           headers={**headers, "content-type": "application/json"})
        assert r.status_code == 422, f"{route.path}: {r.status_code} {r.text}"
        problem = r.json()
        assert r.headers["content-type"].startswith("application/problem+json")
        assert problem["errors"] == [{"field": "", "type": "json_invalid", "line": 2, "column": 18,
                                      "message": problem["errors"][0]["message"]}], route.path
        assert "line 2 column 18" in problem["detail"], problem["detail"]
        seen += 1
    assert seen >= 10


def test_events_page_with_a_cursor_and_follow_with_after(client):
    FakeAgentSession(client, "node-1", 2)
    job = submit(client, num_nodes=1)
    for _ in range(3):
        client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)  # 409s after the first: no event
    every = client.get(f"/v1/jobs/{job['id']}/events", headers=ADMIN).json()
    assert every["next_cursor"] is None and len(every["items"]) >= 2
    ids, cursor = [], None
    while True:
        page = client.get(f"/v1/jobs/{job['id']}/events", params={"limit": 1, **({"cursor": cursor} if cursor else {})},
                          headers=ADMIN).json()
        ids += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert ids == [e["id"] for e in every["items"]]
    newer = client.get(f"/v1/jobs/{job['id']}/events", params={"after": ids[0]}, headers=ADMIN).json()["items"]
    assert [e["id"] for e in newer] == ids[1:]
    bad = client.get(f"/v1/jobs/{job['id']}/events", params={"cursor": "bm90IGEgY3Vyc29y"}, headers=ADMIN)
    assert bad.status_code == 422


# --- Every request number has a documented range (issue 28) -------------------------------------
UNBOUNDED = {"body.progress.loss", "body.progress.metrics.*"}
"""A training loss and a user's metrics: any finite number the script computes (inf and NaN are
refused); a bound would drop a diverging job's reports, which are how its owner sees it diverge."""


def test_every_number_a_request_carries_has_a_range_and_says_it(app):
    from tests.control_plane.openapi_numbers import numeric_fields

    fields = [*numeric_fields(app.openapi()), *numeric_fields(app.state.agent_openapi())]
    assert len(fields) > 100  # both documents walked, bodies and parameters
    undocumented = [f"{f.method} {f.path} {f.field}" for f in fields if not f.description]
    unbounded = [f"{f.method} {f.path} {f.field}" for f in fields if not f.bounded and f.field not in UNBOUNDED]
    assert undocumented == [] and unbounded == []


def test_a_body_that_is_not_utf8_is_a_422_as_any_body_that_is_not_json(client):
    """Issue 28's probes: FastAPI answered a bare 400 (undeclared) for bytes that are not UTF-8."""
    r = client.post("/v1/simulations", content=b'{"nodes": "\xff\xfe"}',
                    headers={**ADMIN, "content-type": "application/json"})
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text
    assert r.json()["errors"][0]["type"] == "json_invalid" and "byte 0xff at offset 11" in r.json()["detail"]
