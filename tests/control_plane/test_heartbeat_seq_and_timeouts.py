"""Finding 10: heartbeat sequence checks read the locked row; a retried heartbeat is liveness; the
timeouts fit inside each other (docs/architecture.md, "Time and timeouts")."""

from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError
from sqlalchemy import select

from control_plane.db import session_scope
from control_plane.models import Node
from control_plane.services.cluster import nodes
from control_plane.settings import Settings
from tests.factories import FakeAgentSession
from trainyard.protocol.agent import (
    AGENT_BACKOFF_S,
    AGENT_TRIES,
    HeartbeatRequest,
    agent_request_timeout_s,
)


def test_sequence_check_reads_the_row_as_locked_not_as_loaded(app, client):
    agent = FakeAgentSession(client, "n1", 1)
    agent.heartbeat()  # seq 1
    factory = app.state.session_factory
    stale = factory()
    try:
        # The request's dependency loaded the node (seq 1) before the heartbeat takes its lock ...
        node = stale.scalars(select(Node).where(Node.id == uuid.UUID(agent.node_id))).one()
        stale.commit()
        # ... meanwhile a newer heartbeat (seq 5) of the same agent commits ...
        with session_scope(factory) as s:
            newer = s.get(Node, node.id)
            assert newer is not None
            nodes.heartbeat(s, newer, HeartbeatRequest(agent_instance="i1", seq=5, attempts=[]))
        # ... so the delayed seq 3 is older truth, whatever the session had loaded.
        nodes.heartbeat(stale, node, HeartbeatRequest(agent_instance="i1", seq=3, attempts=[]))
        stale.commit()
    finally:
        stale.close()
    with session_scope(factory) as s:
        assert s.get(Node, uuid.UUID(agent.node_id)).heartbeat_seq == 5  # type: ignore[union-attr]


def test_a_retried_heartbeat_counts_as_liveness(app, client, clock):
    agent = FakeAgentSession(client, "n1", 1)
    agent.heartbeat()  # seq 1; the node-lost timeout is 2 s here
    clock.advance(1.5)
    agent.heartbeat(seq=agent.seq)  # the agent's retry: same seq, the first answer was lost
    clock.advance(1.5)  # 3 s after the first try, 1.5 s after the retry
    with session_scope(app.state.session_factory) as s:
        lost = nodes.mark_lost_nodes(s, timeout_s=2, not_before=clock.t)
    assert lost == []
    assert client.get(f"/v1/nodes/{agent.node_id}", headers={"Authorization": "Bearer test-admin-token"}
                      ).json()["state"] == "ready"


def test_default_timeouts_fit_inside_each_other():
    s = Settings()
    per_try = s.agent_request_timeout_s
    assert s.heartbeat_interval_s + AGENT_TRIES * per_try + AGENT_BACKOFF_S <= s.node_lost_timeout_s
    assert 0 < s.pool_timeout_s < per_try
    assert s.monitor_interval_s < s.node_lost_timeout_s < s.checkpoint_pending_timeout_s
    # 10 s tries, 3 of them, no longer last as long as the node-lost timeout.
    assert per_try < s.node_lost_timeout_s / AGENT_TRIES


@pytest.mark.parametrize("bad", [
    {"heartbeat_interval_s": 10, "node_lost_timeout_s": 10},
    {"heartbeat_interval_s": 5, "node_lost_timeout_s": 5.5},  # no room for the agent's retries
    {"monitor_interval_s": 20, "node_lost_timeout_s": 10},
    {"checkpoint_pending_timeout_s": 10, "node_lost_timeout_s": 10},
])
def test_timeouts_that_do_not_nest_are_refused(bad):
    with pytest.raises(ValidationError, match="must"):
        Settings(**bad)


def test_pool_timeout_stays_below_the_agents_request_timeout():
    s = Settings(heartbeat_interval_s=1, node_lost_timeout_s=4, db_pool_timeout_s=30)
    assert s.pool_timeout_s == pytest.approx(agent_request_timeout_s(1, 4) / 2)
