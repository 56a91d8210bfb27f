"""A database the control plane cannot reach is an outage, not a bug: every route that needs it
answers 503 problem+json with Retry-After (agents retry), never 500; the process recovers by
itself when the database is back.

Real PostgreSQL behind a TCP proxy that is cut (every connection reset, new ones refused), so the
control plane sees what it sees when the server or the network goes away. Before the fix, a refused
connection (psycopg's OperationalError carries no SQLSTATE) was a 500 on every route, the long poll
``POST /v1/agent/wait`` among them.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from control_plane import clock
from control_plane.app import create_app
from control_plane.openapi import AGENT_DOCUMENT
from control_plane.schemas.plans import PLAN_EXAMPLE
from control_plane.schemas.simulations import SIMULATION_EXAMPLE
from control_plane.settings import Settings
from tests.control_plane.access import make_principal
from tests.e2e.harness import TcpProxy
from tests.factories import ADMIN, JOIN_TOKEN, job_body, register_node

# Every route and a request to it that passes validation, so that what answers is the database.
# A route missing here fails the test: a new route must show it survives an outage too.
REPORT = {"fencing_token": "t", "node_rank": 0}
REQUESTS: dict[tuple[str, str], tuple[str, dict[str, Any] | None]] = {
    ("POST", "/v1/agent/register"): ("join", {"name": "outage-2", "address": "127.0.0.1", "gpus": []}),
    ("POST", "/v1/agent/heartbeat"): ("node", {"agent_instance": "i", "seq": 9, "attempts": []}),
    ("POST", "/v1/agent/wait"): ("node", {"known": [], "timeout_s": 1}),
    ("POST", "/v1/agent/attempts/{attempt_id}/status"): ("node", {**REPORT, "state": "running"}),
    ("POST", "/v1/agent/attempts/{attempt_id}/logs"): ("node", {**REPORT, "chunks": []}),
    ("POST", "/v1/agent/attempts/{attempt_id}/shards"): ("node", {**REPORT, "shards": []}),
    ("POST", "/v1/agent/attempts/{attempt_id}/events"): ("node", {**REPORT, "events": []}),
    ("GET", "/readyz"): ("none", None),
    ("POST", "/v1/jobs"): ("admin", job_body(name="during-outage")),
    ("GET", "/v1/jobs"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}"): ("admin", None),
    ("POST", "/v1/jobs/{job_id}/cancel"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}/attempts"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}/checkpoints"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}/events"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}/logs"): ("admin", None),
    ("GET", "/v1/nodes"): ("admin", None),
    ("GET", "/v1/nodes/{node_id}"): ("admin", None),
    ("DELETE", "/v1/nodes/{node_id}"): ("admin", None),
    ("POST", "/v1/nodes/{node_id}/cordon"): ("admin", None),
    ("POST", "/v1/nodes/{node_id}/drain"): ("admin", None),
    ("POST", "/v1/nodes/{node_id}/uncordon"): ("admin", None),
    ("PUT", "/v1/nodes/{node_id}/labels"): ("admin", {"labels": {"rack": "r1"}}),
    ("GET", "/v1/cluster"): ("admin", None),
    ("GET", "/v1/tenants"): ("admin", None),
    ("PUT", "/v1/tenants/{name}"): ("admin", {"weight": 2}),
    ("POST", "/v1/agent/attempts/{attempt_id}/storage"): (
        "node", {**REPORT, "rank": 0, "method": "GET", "key": "k"}),
    # The bootstrap admin is known without the database; a principal's token is looked up in it.
    ("GET", "/v1/whoami"): ("principal", None),
    ("POST", "/v1/plans"): ("admin", PLAN_EXAMPLE),
    ("GET", "/v1/principals"): ("admin", None),
    ("POST", "/v1/principals"): ("admin", {"name": "bob", "tenant": "t", "role": "viewer"}),
    ("DELETE", "/v1/principals/{name}"): ("admin", None),
    ("GET", "/v1/tokens"): ("admin", None),
    ("POST", "/v1/tokens"): ("principal", {"ttl_s": 60}),
    ("DELETE", "/v1/tokens/{token_id}"): ("admin", None),
    ("GET", "/v1/join-tokens"): ("admin", None),
    ("POST", "/v1/join-tokens"): ("admin", {}),
    ("DELETE", "/v1/join-tokens/{token_id}"): ("admin", None),
    # The model itself needs no database; a principal allowed to run it is looked up in it.
    ("POST", "/v1/simulations"): ("principal", SIMULATION_EXAMPLE),
    ("GET", "/metrics"): ("admin", None),
    ("GET", "/v1/jobs/{job_id}/progress"): ("admin", None),
    ("GET", "/v1/agent/attempts/{attempt_id}/code"): ("node", None),
    ("GET", "/v1/upload-slots"): ("admin", None),
    ("POST", "/v1/agent/attempts/{attempt_id}/upload-slots"): (
        "node", {**REPORT, "rank": 0, "step": 10, "size_bytes": 1, "wait_s": 0}),
    ("POST", "/v1/agent/attempts/{attempt_id}/upload-slots/release"): ("node", {**REPORT, "rank": 0, "step": 10}),
    ("POST", "/v1/agent/attempts/{attempt_id}/upload-slots/batch"): (
        "node", {**REPORT, "wait_s": 0, "asks": [{"rank": 0, "step": 10, "size_bytes": 1}],
                 "releases": [{"rank": 1, "step": 10}]}),
    ("POST", "/v1/agent/attempts/{attempt_id}/storage/batch"): (
        "node", {**REPORT, "requests": [{"rank": 0, "method": "GET", "key": "k"}]}),
}


def test_every_route_answers_503_while_the_database_is_unreachable(settings: Settings) -> None:
    url = make_url(settings.database_url)
    socket_dir = url.query.get("host")  # the embedded server listens on a unix socket only
    proxy = TcpProxy(f"unix:{socket_dir}/.s.PGSQL.{url.query.get('port', 5432)}" if socket_dir
                     else f"{url.host}:{url.port or 5432}")
    proxied = url.set(host="127.0.0.1", port=proxy.port, query={}).render_as_string(hide_password=False)
    app = create_app(settings.model_copy(update={"database_url": proxied}))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            reg = register_node(client, "outage-1", 1)
            job = client.post("/v1/jobs", json=job_body(name="before-outage", num_nodes=1, gpus_per_node=1),
                              headers=ADMIN).json()
            params = {"attempt_id": str(uuid.uuid4()), "job_id": job["id"], "node_id": reg["node_id"], "name": "t",
                      "token_id": str(uuid.uuid4()), "sha256": "0" * 64}
            alice = make_principal(client, "alice", "admin", "t")
            headers = {"admin": ADMIN, "principal": alice.headers, "join": {"Authorization": f"Bearer {JOIN_TOKEN}"},
                       "node": {"Authorization": f"Bearer {reg['node_token']}"}, "none": {}}
            # Both documents: the users' (/openapi.json) and the agents' (/openapi/agent.json).
            docs = [app.openapi(), client.get(AGENT_DOCUMENT).json()]
            routes = {(m.upper(), path) for doc in docs for path, ops in doc["paths"].items() for m in ops}
            routes.discard(("GET", "/healthz"))  # liveness: the process is up, whatever the database
            # Shipped code lives in S3 alone, under the tenant of the caller's token: no database.
            routes -= {("GET", "/v1/code/{sha256}"), ("PUT", "/v1/code/{sha256}")}
            assert routes == set(REQUESTS), f"routes without an outage check: {routes ^ set(REQUESTS)}"

            proxy.cut()
            answers = {}
            for (method, path), (who, body) in sorted(REQUESTS.items()):
                r = client.request(method, path.format(**params), json=body, headers=headers[who])
                answers[(method, path)] = (r.status_code, r.headers.get("content-type", ""),
                                           r.headers.get("retry-after"), r.text[:200])
            wrong = {k: v for k, v in answers.items()
                     if v[0] != 503 or not v[1].startswith("application/problem+json")
                     or (k != ("GET", "/readyz") and v[2] is None)}
            assert wrong == {}, wrong

            proxy.restore()  # the pool reconnects on its own: nothing to restart
            r = client.post("/v1/agent/heartbeat", json={"agent_instance": "i", "seq": 10, "attempts": []},
                            headers=headers["node"])
            assert r.status_code == 200, r.text
            assert client.get("/readyz").status_code == 200
    finally:
        proxy.close()
        clock.reset()
