"""Removing a node through the HTTP API has no dead ends (issue 9, finding 17): a drained and
removed node's agent registers again and its node is usable; a node whose agent still heartbeats
cannot be removed (it would be back within a heartbeat, under the same id, without its cordon)."""

from __future__ import annotations

from control_plane.db import session_scope
from control_plane.services.cluster import nodes
from tests.factories import ADMIN, FakeAgentSession, register_node, reregister_node


def _node(client, node_id):
    r = client.get(f"/v1/nodes/{node_id}", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def _lose(app, clock, seconds=5.0):
    clock.advance(seconds)
    with session_scope(app.state.session_factory) as s:
        return [n.name for n in nodes.mark_lost_nodes(s, timeout_s=2, not_before=clock.t)]


def test_a_drained_then_removed_node_registers_again_and_can_be_uncordoned(app, client, clock):
    agent = FakeAgentSession(client, "gpu-1", 2)
    assert client.post(f"/v1/nodes/{agent.node_id}/drain", headers=ADMIN).status_code == 200
    assert _lose(app, clock) == ["gpu-1"]  # its agent was stopped
    r = client.delete(f"/v1/nodes/{agent.node_id}", headers=ADMIN)
    assert r.status_code == 200 and r.json()["state"] == "removed", r.text

    # Its agent comes back: registering must work (it answered 500 forever before).
    again = register_node(client, "gpu-1", 2)
    assert again["node_id"] == agent.node_id
    node = _node(client, agent.node_id)
    assert node["state"] == "ready" and node["schedulable"] and node["scheduling"] == "schedulable"
    # Every operator action works on it again.
    for action, scheduling in (("drain", "drained"), ("uncordon", "schedulable"), ("cordon", "cordoned")):
        r = client.post(f"/v1/nodes/{agent.node_id}/{action}", headers=ADMIN)
        assert r.status_code == 200 and r.json()["scheduling"] == scheduling, r.text
    # Registering once more (with its credential) keeps the operator's cordon (it is not a removed
    # node coming back).
    reregister_node(client, "gpu-1", again["node_token"], 2)
    assert _node(client, agent.node_id)["scheduling"] == "cordoned"


def test_a_live_node_cannot_be_removed_and_keeps_its_cordon(client):
    agent = FakeAgentSession(client, "gpu-2", 1)
    agent.heartbeat()
    assert client.post(f"/v1/nodes/{agent.node_id}/cordon", headers=ADMIN).status_code == 200
    r = client.delete(f"/v1/nodes/{agent.node_id}", headers=ADMIN)
    assert r.status_code == 409, r.text
    assert "stop its agent" in r.json()["detail"]
    agent.heartbeat()
    node = _node(client, agent.node_id)
    assert node["state"] == "ready" and node["scheduling"] == "cordoned"


def test_register_refuses_bad_gpu_lists_with_4xx(client):
    from tests.factories import JOIN_TOKEN

    body = {"name": "gpu-3", "address": "127.0.0.1", "labels": {},
            "gpus": [{"index": 0, "uuid": "a", "kind": "k", "memory_mb": 0},
                     {"index": 0, "uuid": "b", "kind": "k", "memory_mb": 0}]}
    headers = {"Authorization": f"Bearer {JOIN_TOKEN}"}
    assert client.post("/v1/agent/register", json=body, headers=headers).status_code == 422
    body["gpus"] = [{"index": 0, "uuid": "u" * 500, "kind": "k", "memory_mb": 0}]
    assert client.post("/v1/agent/register", json=body, headers=headers).status_code == 422
