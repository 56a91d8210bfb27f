"""Principals, roles and tokens (issue 11, finding 5), join tokens (finding 2), against a real
PostgreSQL through the API."""

from __future__ import annotations

import hashlib

from sqlalchemy import create_engine, text

from tests.control_plane.access import make_principal, team
from tests.factories import ADMIN, JOIN_TOKEN, job_body, register_body, register_node, reregister_node


def _rows(url: str, sql: str) -> list[tuple]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(sql))]
    finally:
        engine.dispose()


def test_tokens_are_shown_once_stored_hashed_listed_and_revoked(client, settings):
    alice = make_principal(client, "alice", "member", "vision")
    assert alice.token.startswith("tyt_")
    me = client.get("/v1/whoami", headers=alice.headers).json()
    assert me["name"] == "alice" and me["tenant"] == "vision" and me["role"] == "member"
    # Only the sha256 is stored; no column holds the token.
    hashes = [h for (h,) in _rows(settings.database_url, "SELECT token_hash FROM api_tokens")]
    assert hashes == [hashlib.sha256(alice.token.encode()).hexdigest()]
    dump = str(_rows(settings.database_url, "SELECT * FROM api_tokens")) + str(
        _rows(settings.database_url, "SELECT * FROM principals"))
    assert alice.token not in dump

    # A second token (rotation), listed without secrets; the first revoked.
    second = client.post("/v1/tokens", json={"description": "ci", "ttl_s": 3600}, headers=alice.headers)
    assert second.status_code == 201 and second.json()["token"] != alice.token
    listed = client.get("/v1/tokens", headers=alice.headers).json()
    assert len(listed) == 2 and all("token" not in t for t in listed)
    first_id = next(t["id"] for t in listed if t["description"] == "first token")
    assert client.delete(f"/v1/tokens/{first_id}", headers=alice.headers).json()["revoked_at"]
    assert client.get("/v1/whoami", headers=alice.headers).status_code == 401
    new = {"Authorization": f"Bearer {second.json()['token']}"}
    assert client.get("/v1/whoami", headers=new).status_code == 200

    # Nobody else sees or revokes alice's tokens; an admin does.
    bob = make_principal(client, "bob", "member", "vision")
    assert client.get("/v1/tokens", params={"principal": "alice"}, headers=bob.headers).status_code == 403
    assert client.delete(f"/v1/tokens/{second.json()['id']}", headers=bob.headers).status_code == 404
    assert client.post("/v1/tokens", json={"principal": "alice"}, headers=bob.headers).status_code == 403
    assert len(client.get("/v1/tokens", params={"principal": "alice"}, headers=ADMIN).json()) == 2
    # Disabling a principal refuses all its tokens.
    assert client.delete("/v1/principals/alice", headers=ADMIN).json()["disabled_at"]
    assert client.get("/v1/whoami", headers=new).status_code == 401
    # The bootstrap admin's name is taken; names are unique.
    assert client.post("/v1/principals", json={"name": "admin", "tenant": "t", "role": "admin"},
                       headers=ADMIN).status_code == 409
    assert client.post("/v1/principals", json={"name": "bob", "tenant": "t", "role": "viewer"},
                       headers=ADMIN).status_code == 409


def test_an_expired_token_is_refused(client, clock):
    carol = make_principal(client, "carol", "viewer", "vision")
    short = client.post("/v1/tokens", json={"ttl_s": 60}, headers=carol.headers).json()
    headers = {"Authorization": f"Bearer {short['token']}"}
    assert client.get("/v1/whoami", headers=headers).status_code == 200
    clock.advance(61)
    assert client.get("/v1/whoami", headers=headers).status_code == 401
    assert client.get("/v1/whoami", headers=carol.headers).status_code == 200  # no expiry


def test_a_token_made_by_a_token_never_outlives_it(client, clock):
    """A short-lived token (stolen, say) cannot mint itself a permanent one: a self token expires no
    later than the token that made it."""
    carol = make_principal(client, "carol", "member", "vision")
    short = client.post("/v1/tokens", json={"ttl_s": 600}, headers=carol.headers).json()
    as_short = {"Authorization": f"Bearer {short['token']}"}
    forever = client.post("/v1/tokens", json={"description": "no ttl asked"}, headers=as_short)
    longer = client.post("/v1/tokens", json={"ttl_s": 86400}, headers=as_short)
    assert forever.status_code == longer.status_code == 201, forever.text
    for made in (forever.json(), longer.json()):
        assert made["expires_at"] == short["expires_at"], made
    grandchild = client.post("/v1/tokens", json={}, headers={"Authorization": f"Bearer {forever.json()['token']}"})
    assert grandchild.status_code == 201 and grandchild.json()["expires_at"] == short["expires_at"]
    clock.advance(601)
    for token in (forever.json()["token"], longer.json()["token"], grandchild.json()["token"]):
        assert client.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"}).status_code == 401

    # A token made from an unexpiring one asks for what it wants.
    child = client.post("/v1/tokens", json={}, headers=carol.headers).json()
    assert child["expires_at"] is None


def test_the_tenant_comes_from_the_principal_and_priority_is_capped(client):
    register_node(client, "node-1", 2)
    a = team(client, "vision")
    member = a["member"]
    job = client.post("/v1/jobs", json=job_body(num_nodes=1), headers=member.headers)
    assert job.status_code == 201 and job.json()["tenant"] == "vision"
    # Naming another tenant is refused for everyone but an admin (who submits on behalf of a team).
    other = client.post("/v1/jobs", json=job_body(num_nodes=1, tenant="nlp"), headers=member.headers)
    assert other.status_code == 403 and "cannot submit for tenant 'nlp'" in other.json()["detail"]
    assert client.post("/v1/jobs", json=job_body(num_nodes=1, tenant="vision"), headers=member.headers
                       ).status_code == 201
    assert client.post("/v1/jobs", json=job_body(num_nodes=1, tenant="nlp"), headers=a["admin"].headers
                       ).json()["tenant"] == "nlp"
    # Priority above the tenant's cap (0 until an operator raises it) is refused, then allowed.
    high = client.post("/v1/jobs", json=job_body(num_nodes=1, priority=5), headers=member.headers)
    assert high.status_code == 403 and "max_priority 0" in high.json()["detail"]
    r = client.put("/v1/tenants/vision", json={"max_priority": 5}, headers=a["operator"].headers)
    assert r.status_code == 200 and r.json()["max_priority"] == 5
    assert client.post("/v1/jobs", json=job_body(num_nodes=1, priority=5), headers=member.headers
                       ).json()["priority"] == 5
    assert client.post("/v1/jobs", json=job_body(num_nodes=1, priority=6), headers=member.headers
                       ).status_code == 403
    # Viewers and operators submit nothing; members cancel their tenant's jobs only.
    assert client.post("/v1/jobs", json=job_body(num_nodes=1), headers=a["viewer"].headers).status_code == 403
    assert client.post("/v1/jobs", json=job_body(num_nodes=1), headers=a["operator"].headers).status_code == 403
    assert client.post(f"/v1/jobs/{job.json()['id']}/cancel", headers=member.headers).json()["state"] == "cancelled"
    events = client.get(f"/v1/jobs/{job.json()['id']}/events", headers=member.headers).json()["items"]
    assert events[0]["data"]["principal"] == member.name and events[-1]["message"] == f"cancelled by {member.name}"


def test_submits_past_the_rate_are_429_with_retry_after(app, client):
    register_node(client, "node-1", 2)
    app.state.settings = app.state.settings.model_copy(update={"submit_rate_per_window": 3})
    member = make_principal(client, "dave", "member", "vision")
    codes = [client.post("/v1/jobs", json=job_body(num_nodes=1, name=f"j{i}"), headers=member.headers).status_code
             for i in range(4)]
    assert codes == [201, 201, 201, 429]
    r = client.post("/v1/jobs", json=job_body(num_nodes=1, name="late"), headers=member.headers)
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["content-type"].startswith("application/problem+json")
    # A new Idempotency-Key is a new job: refused as well.
    first = client.post("/v1/jobs", json=job_body(num_nodes=1, name="j0"),
                        headers={**member.headers, "Idempotency-Key": "k"})
    assert first.status_code == 429
    other = make_principal(client, "erin", "member", "vision")  # per principal
    assert client.post("/v1/jobs", json=job_body(num_nodes=1), headers=other.headers).status_code == 201
    assert client.post("/v1/jobs", json=job_body(num_nodes=1), headers=ADMIN).status_code == 201  # admins: no limit


def test_join_tokens_expire_are_single_use_and_never_take_a_registered_node(client, clock):
    operator = make_principal(client, "ops", "operator", "infra")
    made = client.post("/v1/join-tokens", json={}, headers=operator.headers)
    assert made.status_code == 201 and made.json()["max_uses"] == 1 and made.json()["token"].startswith("tyj_")
    join = {"Authorization": f"Bearer {made.json()['token']}"}
    r = client.post("/v1/agent/register", json=register_body("gpu-1", 1), headers=join)
    assert r.status_code == 200, r.text
    first = r.json()
    # Single-use: the same token registers nothing else.
    assert client.post("/v1/agent/register", json=register_body("gpu-2", 1), headers=join).status_code == 401
    listed = client.get("/v1/join-tokens", headers=operator.headers).json()
    assert listed[0]["uses"] == 1 and listed[0]["usable"] is False and "token" not in listed[0]

    # A registered node's name is not taken with another (unbound) join token, nor the static one...
    many = client.post("/v1/join-tokens", json={"max_uses": None, "ttl_s": 120}, headers=operator.headers).json()
    for token in (many["token"], JOIN_TOKEN):
        r = client.post("/v1/agent/register", json=register_body("gpu-1", 1),
                        headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 409 and r.json()["type"].endswith("/node-name-taken"), r.text
    # ...but with its own credential, or a join token an operator made for that name.
    again = reregister_node(client, "gpu-1", first["node_token"], 1)
    assert again["node_id"] == first["node_id"] and again["agent_epoch"] == first["agent_epoch"] + 1
    assert client.post("/v1/agent/register", json=register_body("gpu-1", 1),
                       headers={"Authorization": f"Bearer {first['node_token']}"}).status_code == 409  # stale
    bound = client.post("/v1/join-tokens", json={"node_name": "gpu-1"}, headers=operator.headers).json()
    r = client.post("/v1/agent/register", json=register_body("gpu-1", 1),
                    headers={"Authorization": f"Bearer {bound['token']}"})
    assert r.status_code == 200 and r.json()["node_id"] == first["node_id"]
    other = client.post("/v1/join-tokens", json={"node_name": "gpu-9"}, headers=operator.headers).json()
    assert client.post("/v1/agent/register", json=register_body("gpu-3", 1),
                       headers={"Authorization": f"Bearer {other['token']}"}).status_code == 401
    # Expired and revoked tokens register nothing.
    assert client.post("/v1/agent/register", json=register_body("gpu-4", 1),
                       headers={"Authorization": f"Bearer {many['token']}"}).status_code == 200
    clock.advance(121)
    assert client.post("/v1/agent/register", json=register_body("gpu-5", 1),
                       headers={"Authorization": f"Bearer {many['token']}"}).status_code == 401
    fresh = client.post("/v1/join-tokens", json={}, headers=operator.headers).json()
    assert client.delete(f"/v1/join-tokens/{fresh['id']}", headers=operator.headers).json()["usable"] is False
    assert client.post("/v1/agent/register", json=register_body("gpu-6", 1),
                       headers={"Authorization": f"Bearer {fresh['token']}"}).status_code == 401
    # Members and viewers make none.
    member = make_principal(client, "m", "member", "vision")
    assert client.post("/v1/join-tokens", json={}, headers=member.headers).status_code == 403
