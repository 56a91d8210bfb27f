"""Agent instances at the API: each registration is a new epoch; an older epoch's credential is
refused with 409 stale-agent (stop), an unknown one with 401 (register)."""

from __future__ import annotations

from tests.factories import register_node, reregister_node

HB = {"agent_instance": "a", "seq": 1, "attempts": []}


def test_an_older_instance_is_refused_as_stale_and_the_newer_one_is_served(client):
    first = register_node(client, "n1")
    second = reregister_node(client, "n1", first["node_token"])
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
