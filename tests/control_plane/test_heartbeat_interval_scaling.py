"""Finding 21 (1,000 agents): the heartbeat interval agents are told grows with the cluster, to keep
the control plane's heartbeat rate near ``heartbeat_target_rate_per_s``; the node-lost timeout grows
by as much, per node, so every timeout still nests (docs/architecture.md, "Time and timeouts")."""

from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError

from control_plane.db import session_scope
from control_plane.models import Node
from control_plane.services.cluster import nodes
from control_plane.settings import Settings
from tests.factories import FakeAgentSession
from trainyard.protocol.agent import AGENT_BACKOFF_S, AGENT_TRIES, agent_request_timeout_s


def test_interval_scales_with_node_count_and_every_timeout_nests():
    s = Settings(heartbeat_target_rate_per_s=100)
    assert s.interval_for(10) == s.heartbeat_interval_s == 1.0  # a small cluster: the configured one
    assert s.interval_for(250) == 2.5 and s.interval_for(1000) == 10.0
    assert Settings().interval_for(1000) == 25.0  # the default: 40 heartbeats/s in all
    assert s.interval_for(10**6) == s.heartbeat_interval_max_s  # capped
    per_try = s.agent_request_timeout_s
    for n in (1, 250, 1000, 2000, 10**6):
        interval = s.interval_for(n)
        lost = s.lost_timeout_for(interval)
        # An agent told `interval` derives the same per-try timeout as at the base interval, and a
        # heartbeat with all its retries still arrives before its node is declared lost.
        assert agent_request_timeout_s(interval, lost) == pytest.approx(per_try)
        assert interval + AGENT_TRIES * per_try + AGENT_BACKOFF_S <= lost + 1e-9
        assert s.monitor_interval_s < lost < s.attempt_launch_timeout_s
        assert lost + s.checkpoint_maintenance_interval_s < s.checkpoint_pending_timeout_s


@pytest.mark.parametrize("bad", [
    {"heartbeat_interval_max_s": 0.5},  # shorter than heartbeat_interval_s
    {"heartbeat_interval_max_s": 100},  # the lost timeout at 100 s outlasts the launch timeout (60 s)
    {"heartbeat_interval_max_s": 50, "attempt_launch_timeout_s": 1000, "checkpoint_pending_timeout_s": 55},
])
def test_a_maximum_interval_whose_lost_timeout_does_not_nest_is_refused(bad):
    with pytest.raises(ValidationError, match="must"):
        Settings(**bad)


def test_agents_are_told_the_scaled_interval_and_the_monitor_waits_for_it(app, client, clock, settings):
    # Here: 1 heartbeat/s target, so n nodes are told n seconds (at most 15 s); lost timeout 2 s at 1 s.
    settings.heartbeat_target_rate_per_s = 1.0
    first = FakeAgentSession(client, "n1", 1)
    assert first.heartbeat()["heartbeat_interval_s"] == 1.0
    others = [FakeAgentSession(client, f"n{i}", 1) for i in range(2, 5)]
    r = client.post("/v1/agent/register", json={"name": "n5", "address": "127.0.0.5", "gpus": []},
                    headers={"Authorization": "Bearer test-join-token"})
    assert r.status_code == 200, r.text
    assert r.json()["heartbeat_interval_s"] == 5.0
    assert r.json()["node_lost_timeout_s"] == 6.0  # the same 1 s slack on top of the interval
    assert first.heartbeat()["heartbeat_interval_s"] == 5.0  # an agent learns it at its next heartbeat
    for agent in others:
        agent.heartbeat()
    clock.advance(3.0)  # past the base lost timeout (2 s), well inside the told one (6 s)
    with session_scope(app.state.session_factory) as s:
        lost = nodes.mark_lost_nodes(s, timeout_s=settings.node_lost_timeout_s, not_before=clock.t,
                                     interval_s=settings.heartbeat_interval_s)
    assert lost == []
    clock.advance(3.5)
    with session_scope(app.state.session_factory) as s:
        lost = nodes.mark_lost_nodes(s, timeout_s=settings.node_lost_timeout_s, not_before=clock.t,
                                     interval_s=settings.heartbeat_interval_s)
        assert sorted(n.name for n in lost) == ["n1", "n2", "n3", "n4", "n5"]
        told = s.get(Node, uuid.UUID(first.node_id))
        assert told is not None and told.heartbeat_interval_s == 5.0
