"""The two OpenAPI documents and the pages that show them, without a CDN.

- ``/openapi.json``: the users' API (jobs, nodes, tenants, access, plans, health). Every error
  status answers ``application/problem+json`` with the ``Problem`` schema, FastAPI's own 422 body
  (which this API never sends) replaced by it, so that a generated client (openapi-python-client)
  parses errors as well as answers.
- ``/openapi/agent.json``: the node agents' side (``/v1/agent``), kept out of the users' document
  and its pages: nobody writes a client for it but the agent (trainyard/protocol/agent.py).
- ``/docs`` (Swagger UI 5, from the ``swagger-ui-bundle-v2`` package) and ``/redoc`` (vendored under
  control_plane/static/redoc) load every asset from this server: an air-gapped cluster shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from control_plane.api.deps import api_routes
from control_plane.errors import PROBLEM_JSON
from control_plane.schemas.problems import Problem
from trainyard.protocol.agent import AGENT_API_PREFIX

STATIC_DIR = Path(__file__).resolve().parent / "static"
USER_DOCUMENT = "/openapi.json"
AGENT_DOCUMENT = "/openapi/agent.json"
_REF = "#/components/schemas/{model}"
_FASTAPI_422 = ("HTTPValidationError", "ValidationError")


def is_agent_route(route: Any) -> bool:
    return isinstance(route, APIRoute) and route.path.startswith(AGENT_API_PREFIX + "/")


def _document(app: FastAPI, routes: list[Any], title: str, description: str) -> dict[str, Any]:
    doc = get_openapi(title=title, version=app.version, description=description, routes=routes,
                      tags=app.openapi_tags, servers=app.servers)
    declare_problems(doc)
    # Operation ids are the route functions' names (unique, checked by test_api_documents): a generated
    # client gets api/jobs/submit_job rather than submit_job_v1_jobs_post.
    for route in routes:
        for method in route.methods:
            operation = doc["paths"].get(route.path_format, {}).get(method.lower())
            if operation is not None:
                operation["operationId"] = route.name
    return doc


def declare_problems(doc: dict[str, Any]) -> None:
    """Every 4xx/5xx answer of every operation: problem+json with the Problem schema."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    problem = Problem.model_json_schema(ref_template=_REF)
    schemas.update(problem.pop("$defs", {}))
    schemas["Problem"] = problem
    ref = {"$ref": _REF.format(model="Problem")}
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            for status, response in operation.get("responses", {}).items():
                if status[:1] in ("4", "5"):
                    response["content"] = {PROBLEM_JSON: {"schema": ref}}
                    if status == "422":
                        response["description"] = "A field or the body is invalid (each in `errors`)."
    used = str(doc.get("paths"))
    for name in _FASTAPI_422:
        if f"/{name}'" not in used:
            schemas.pop(name, None)


def install(app: FastAPI, user_description: str) -> None:
    """Replace FastAPI's ``app.openapi`` with the users' document (cached, like FastAPI's) and keep
    the agents' document beside it (``app.state.agent_openapi``)."""
    def user() -> dict[str, Any]:
        if app.openapi_schema is None:
            routes = [r for r in api_routes(app.routes) if not is_agent_route(r)]
            app.openapi_schema = _document(app, routes, app.title, user_description)
        return app.openapi_schema

    cached: dict[str, Any] = {}

    def agent() -> dict[str, Any]:
        if not cached:
            routes = [r for r in api_routes(app.routes) if is_agent_route(r)]
            cached.update(_document(app, routes, f"{app.title} agent protocol",
                                    "What node agents call (trainyard/protocol/agent.py). Not for users."))
        return cached

    app.openapi = user  # type: ignore[method-assign]
    app.state.agent_openapi = agent
