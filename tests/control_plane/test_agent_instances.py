"""Agent instances at the API: each registration is a new epoch; an older epoch's credential is
refused with 409 stale-agent (stop), an unknown one with 401 (register). A name held by a live agent
instance is not taken by another one (409 node-name-in-use) unless it presents the node's current
credential (the same agent restarting), the node is lost or removed, or an operator forces it."""

from __future__ import annotations

from tests.factories import JOIN_TOKEN, register_node

HB = {"agent_instance": "a", "seq": 1, "attempts": []}


def test_an_older_instance_is_refused_as_stale_and_the_newer_one_is_served(client):
    first = register_node(client, "n1")
    second = register_node(client, "n1", replace=True)  # an operator's takeover
    assert first["node_id"] == second["node_id"]
    assert second["agent_epoch"] == first["agent_epoch"] + 1

    old = {"Authorization": f"Bearer {first['node_token']}"}
    r = client.post("/v1/agent/heartbeat", json=HB, headers=old)
    assert r.status_code == 409 and r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["type"].endswith("/stale-agent") and "another agent instance registered as node n1" in body["detail"]
    assert body["agent_epoch"] == second["agent_epoch"] and body["credential_epoch"] == first["agent_epoch"]
    for path, payload in [("/v1/agent/attempts/00000000-0000-0000-0000-000000000000/status",
                           {"fencing_token": "t", "node_rank": 0, "state": "running"}),
                          ("/v1/agent/attempts/00000000-0000-0000-0000-000000000000/logs",
                           {"fencing_token": "t", "node_rank": 0, "chunks": []})]:
        assert client.post(path, json=payload, headers=old).status_code == 409

    new = {"Authorization": f"Bearer {second['node_token']}"}
    assert client.post("/v1/agent/heartbeat", json=HB, headers=new).status_code == 200
    # Unknown or malformed credentials, including one naming the node with its current epoch, are 401.
    forged = first["node_token"].rsplit(".", 1)[0].rsplit(".", 1)[0] + f".{second['agent_epoch']}.x"
    for token in ["tyn_garbage", "tyn_zz.1.x", forged, "nonsense"]:
        r = client.post("/v1/agent/heartbeat", json=HB, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 401, (token, r.text)


def _register(client, name: str, *, token: str | None = None, instance: str | None = None):
    return client.post("/v1/agent/register", headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, json={
        "name": name, "address": "10.0.0.9", "gpus": [], "node_token": token, "agent_instance": instance})


def test_a_live_node_is_not_taken_by_another_instance_and_the_two_do_not_take_turns(client, clock, settings):
    """Two agents with one name: the first keeps the node while it heartbeats; the other is refused
    until the node is silent for its lost timeout. Before, the last to register won, and an old
    agent restarted by its supervisor took the node back: they took turns."""
    first = register_node(client, "n1")
    alive = {"Authorization": f"Bearer {first['node_token']}"}
    assert client.post("/v1/agent/heartbeat", json=HB, headers=alive).status_code == 200

    r = _register(client, "n1", instance="other-host")
    assert r.status_code == 409 and r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["type"].endswith("/node-name-in-use") and body["node"] == "n1" and body["address"] == "127.0.0.1"
    assert "alive under another agent instance" in body["detail"] and body["lost_after_s"] == 2
    assert client.post("/v1/agent/heartbeat", json={**HB, "seq": 2}, headers=alive).status_code == 200

    # The same agent restarting presents its credential (kept in its work dir): let in at once.
    restarted = _register(client, "n1", token=first["node_token"], instance="first-again")
    assert restarted.status_code == 200, restarted.text
    current = restarted.json()
    assert current["agent_epoch"] == first["agent_epoch"] + 1
    # Its previous credential is now an older epoch's: refused at the door, as the wrong credential.
    r = _register(client, "n1", token=first["node_token"], instance="first-stale")
    assert r.status_code == 409 and r.json()["type"].endswith("/node-name-in-use")

    # Once the node has been silent for its lost timeout, the other instance gets it ...
    clock.advance(settings.node_lost_timeout_s + 0.5)
    taken = _register(client, "n1", instance="other-host")
    assert taken.status_code == 200, taken.text
    other = {"Authorization": f"Bearer {taken.json()['node_token']}"}
    r = client.post("/v1/agent/heartbeat", json={**HB, "agent_instance": "other-host"}, headers=other)
    assert r.status_code == 200
    # ... and the old agent, back with its credential (a stale epoch now), neither takes it back
    # nor goes on: its requests say stop, its registrations are refused.
    old = {"Authorization": f"Bearer {current['node_token']}"}
    assert client.post("/v1/agent/heartbeat", json={**HB, "seq": 3}, headers=old).json()["type"].endswith(
        "/stale-agent")
    r = _register(client, "n1", token=current["node_token"], instance="first-again")
    assert r.status_code == 409 and r.json()["type"].endswith("/node-name-in-use")
    assert client.post("/v1/agent/heartbeat", json={**HB, "agent_instance": "other-host", "seq": 2},
                       headers=other).status_code == 200
