"""The outbox's node-wide budget (issue 11, finding 9): many attempts on one node cannot grow the
agent without bound, and one attempt's flood costs no other attempt within its fair share."""

from __future__ import annotations

from http import HTTPStatus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node_agent.config import AgentConfig
from node_agent.link.outbox import DROPPED_EVENT, MAX_BYTES_PER_NODE, MAX_ITEMS_PER_NODE, Outbox
from trainyard.protocol.agent import ShardInfo, WorkerEvent

SHA = "0" * 64


def _event(i: int, size: int = 0) -> WorkerEvent:
    return WorkerEvent(rank=0, kind="note", message="x" * size, data={"i": i})


def _shard(step: int) -> ShardInfo:
    return ShardInfo(rank=0, step=step, world_size=1, key=f"jobs/j/step-{step}/rank-0", size_bytes=1, sha256=SHA)


def _drain(outbox: Outbox, attempt_id: str) -> list[ShardInfo | WorkerEvent]:
    bodies: list[ShardInfo | WorkerEvent] = []
    while (batch := outbox.next_batch(attempt_id)) is not None:
        bodies += [item.body for item in batch.items]
        outbox.settle(batch, HTTPStatus.OK, {})
    return bodies


def test_many_attempts_within_their_own_budgets_are_bounded_by_the_nodes() -> None:
    """Each attempt stays under its own budget, yet together they would pass the node's: the
    node's budget holds, and the item a worker waits on is refused with a clear 503."""
    outbox = Outbox(max_items=100, node_max_items=250)
    waiter = outbox.put("att-0", "shard", _shard(0), wait=True)
    for i in range(1, 60):
        outbox.put("att-0", "shard", _shard(i))
    for a in range(1, 10):
        for i in range(60):
            outbox.put(f"att-{a}", "event", _event(i))
    items, _ = outbox.usage()
    assert items <= 250
    assert sum(outbox.pending(f"att-{a}") for a in range(10)) == items
    # att-0's shard went with the rest of the oldest: its worker was told why.
    assert waiter is not None and waiter.wait(0) and waiter.status == HTTPStatus.SERVICE_UNAVAILABLE
    assert "node's outbox is full" in waiter.payload["detail"]
    notices = [b for b in _drain(outbox, "att-0") if isinstance(b, WorkerEvent) and b.kind == DROPPED_EVENT]
    assert len(notices) == 1 and "for this node" in notices[0].message
    assert notices[0].data["shards"] > 0 and notices[0].data["events"] == 0


def test_a_flooding_attempt_loses_its_own_items_not_a_quiet_attempts() -> None:
    outbox = Outbox(node_max_bytes=40_000)
    quiet = [outbox.put("quiet", "shard", _shard(step), wait=True) for step in range(5)]
    for i in range(200):
        outbox.put("flood", "event", _event(i, size=1000))
    _, held = outbox.usage()
    assert held <= 40_000
    assert not any(w is not None and w.wait(0) for w in quiet)  # none refused, all still queued
    assert [b.step for b in _drain(outbox, "quiet") if isinstance(b, ShardInfo)] == list(range(5))
    kept = _drain(outbox, "flood")
    notes = [b.data["i"] for b in kept if isinstance(b, WorkerEvent) and b.kind == "note"]
    assert notes == list(range(200 - len(notes), 200))  # the flood's newest kept, in order
    notice = next(b for b in kept if isinstance(b, WorkerEvent) and b.kind == DROPPED_EVENT)
    assert notice.data["events"] == 200 - len(notes)
    assert outbox.usage() == (0, 0)  # settled and drained: the node's count is back to nothing


@settings(max_examples=60, deadline=None)
@given(
    puts=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 400), st.booleans()), max_size=300),
    node_items=st.integers(8, 60),
    node_bytes=st.integers(3_000, 30_000),
)
def test_node_budget_holds_and_no_attempt_within_its_share_loses_an_item(
    puts: list[tuple[int, int, bool]], node_items: int, node_bytes: int,
) -> None:
    """Whatever the interleaving: the node's totals stay within its budget (give or take the
    notices, which are never dropped: one per attempt), and an attempt that never held more than
    its fair share of the node (the budget over the attempts queued) lost nothing."""
    outbox = Outbox(node_max_items=node_items, node_max_bytes=node_bytes)
    attempts = {f"att-{a}" for a, _, _ in puts}
    share_items, share_bytes = node_items // max(1, len(attempts)) - 1, node_bytes // max(1, len(attempts))
    sent: dict[str, int] = {}
    sent_bytes: dict[str, int] = {}
    for n, (a, size, is_shard) in enumerate(puts):
        attempt_id = f"att-{a}"
        body: ShardInfo | WorkerEvent = _shard(n) if is_shard else _event(n, size)
        outbox.put(attempt_id, "shard" if is_shard else "event", body)
        sent[attempt_id] = sent.get(attempt_id, 0) + 1
        sent_bytes[attempt_id] = sent_bytes.get(attempt_id, 0) + len(body.model_dump_json())
        items, held = outbox.usage()
        assert items <= max(node_items, len(attempts) + 1)
        assert held <= node_bytes + len(attempts) * 400 + len(body.model_dump_json())
    for attempt_id in attempts:
        bodies = _drain(outbox, attempt_id)
        dropped = [b for b in bodies if isinstance(b, WorkerEvent) and b.kind == DROPPED_EVENT]
        if sent[attempt_id] <= share_items and sent_bytes[attempt_id] <= share_bytes:
            assert not dropped and len(bodies) == sent[attempt_id]
    assert outbox.usage() == (0, 0)


@pytest.mark.usefixtures("keep_logging")
def test_the_agent_takes_the_node_budget_from_its_config(tmp_path: object) -> None:
    base = {"control_plane_url": "http://127.0.0.1:1", "join_token": "t", "name": "n", "address": "127.0.0.1"}
    config = AgentConfig(**base, work_dir=tmp_path)  # type: ignore[arg-type]
    assert (config.outbox_max_items, config.outbox_max_bytes) == (MAX_ITEMS_PER_NODE, MAX_BYTES_PER_NODE)
    with pytest.raises(ValueError, match="outbox_max_items"):
        AgentConfig(**base, work_dir=tmp_path, outbox_max_items=1)  # type: ignore[arg-type]
    from node_agent.options import parse_args

    token = tmp_path / "token"  # type: ignore[operator]
    token.write_text("t\n")
    parsed = parse_args(["--control-plane", "http://127.0.0.1:1", "--name", "n", "--address", "127.0.0.1",
                         "--join-token-file", str(token), "--work-dir", str(tmp_path),
                         "--outbox-max-items", "500", "--outbox-max-mb", "2"])
    assert (parsed.outbox_max_items, parsed.outbox_max_bytes) == (500, 2 * 2**20)
