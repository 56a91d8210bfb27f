"""The relay of shards and events, against the fake control plane over real HTTP (no torchrun)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http import HTTPStatus

import pytest

from node_agent.link.client import ControlPlaneClient, ControlPlaneUnavailable, RetryPolicy, StaleAttempt
from node_agent.link.outbox import Outbox
from node_agent.link.relay import Relay
from tests.node_agent.fake_control_plane import FakeControlPlane
from trainyard.protocol.agent import GpuInfo, RegisterRequest, ShardInfo, ShardReport, WorkerEvent

SHA = "cd" * 32


def shard(step: int, rank: int, world_size: int = 2, key: str | None = None) -> ShardInfo:
    key = key or f"jobs/j/checkpoints/step-{step:09d}/attempt-0001/rank-{rank}"
    return ShardInfo(rank=rank, step=step, world_size=world_size, key=key, size_bytes=1, sha256=SHA)


def event(kind: str) -> WorkerEvent:
    return WorkerEvent(rank=0, kind=kind, message=kind)


@dataclass
class Setup:
    plane: FakeControlPlane
    outbox: Outbox
    relay: Relay
    stale: list[tuple[str, StaleAttempt]] = field(default_factory=list)
    unauthorized: list[bool] = field(default_factory=list)
    running: set[str] = field(default_factory=lambda: {"att-1", "att-2"})

    def drain(self, rounds: int = 50) -> None:
        """Step the relay until nothing is left to send now."""
        for _ in range(rounds):
            self.relay.step()
            if not self.outbox.attempts():
                return
        raise AssertionError(f"outbox not drained: {self.outbox.attempts()}")


@pytest.fixture
def setup() -> Iterator[Setup]:
    plane = FakeControlPlane().start()
    client = ControlPlaneClient(plane.url, join_token=plane.join_token, retry=RetryPolicy(attempts=1), timeout_s=2)
    client.register(RegisterRequest(name="n", address="127.0.0.1",
                                    gpus=[GpuInfo(index=0, uuid="u", kind="k", memory_mb=0)]))
    outbox = Outbox(max_batch=3)
    holder: list[Setup] = []
    relay = Relay(
        outbox,
        client,
        target=lambda a: (f"fence-{a}", 0) if a in holder[0].running else None,
        on_stale=lambda a, exc: holder[0].stale.append((a, exc)),
        on_unauthorized=lambda: holder[0].unauthorized.append(True),
        max_backoff_s=0.2,
    )
    holder.append(Setup(plane, outbox, relay))
    try:
        yield holder[0]
    finally:
        client.close()
        plane.stop()


def test_order_is_kept_across_kinds_and_batches(setup: Setup) -> None:
    items: list[ShardInfo | WorkerEvent] = [
        event("checkpoint.restored"), *(shard(10 * s, r) for s in (1, 2) for r in (0, 1)), event("done"), shard(30, 0)
    ]
    for item in items:
        setup.outbox.put("att-1", "shard" if isinstance(item, ShardInfo) else "event", item)
    waiter = setup.outbox.put("att-2", "shard", shard(10, 0, world_size=1), wait=True)
    setup.drain()
    assert setup.plane.arrived("att-1") == [
        "event:checkpoint.restored", "shard:10:0", "shard:10:1", "shard:20:0", "shard:20:1", "event:done", "shard:30:0"
    ]
    assert setup.plane.shard_batches["att-1"] == [3, 1, 1]  # at most max_batch, never across kinds
    assert waiter is not None and waiter.wait(0)
    assert (waiter.status, waiter.payload) == (HTTPStatus.OK, {"accepted": 1, "committed_steps": [10]})
    assert setup.plane.senders["att-1"] == {("fence-att-1", 0)}
    assert setup.outbox.pending("att-1") == 0


def test_stale_drops_the_queue_and_reports_it(setup: Setup) -> None:
    setup.plane.stale_shards.add("att-1")
    waiter = setup.outbox.put("att-1", "shard", shard(10, 0), wait=True)
    setup.outbox.put("att-1", "event", event("later"))
    setup.outbox.put("att-2", "event", event("other"))
    setup.drain()
    assert [a for a, _ in setup.stale] == ["att-1"] and setup.stale[0][1].fencing
    assert waiter is not None and waiter.wait(0) and waiter.status == HTTPStatus.CONFLICT
    assert setup.plane.arrived("att-1") == [] and setup.plane.arrived("att-2") == ["event:other"]


def test_refused_batch_is_resent_singly_and_only_the_bad_item_dropped(setup: Setup) -> None:
    bad = shard(10, 1, key="elsewhere/rank-1")
    setup.plane.conflicting_keys.add(bad.key)
    setup.outbox.put("att-1", "shard", shard(10, 0))
    waiter = setup.outbox.put("att-1", "shard", bad, wait=True)
    setup.outbox.put("att-1", "shard", shard(20, 0))
    setup.outbox.put("att-1", "shard", shard(20, 1))
    setup.drain()
    assert not setup.stale  # a typed 409 that is no fencing stops nothing
    assert waiter is not None and waiter.wait(0)
    assert waiter.status == HTTPStatus.UNPROCESSABLE_ENTITY and waiter.payload["upstream_status"] == 409
    assert setup.plane.arrived("att-1") == ["shard:10:0", "shard:20:0", "shard:20:1"]
    assert setup.plane.shard_batches["att-1"] == [1, 1, 1]


def test_outage_keeps_items_until_the_control_plane_is_back(setup: Setup) -> None:
    setup.plane.down = True
    for step in (1, 2, 3):
        setup.outbox.put("att-1", "shard", shard(step, 0))
    waits = [setup.relay.step() for _ in range(3)]
    assert setup.relay.failed_sends >= 1 and any(w > 0 for w in waits)  # backs off
    assert setup.outbox.pending("att-1") == 3 and setup.plane.arrived("att-1") == []
    setup.plane.down = False
    for _ in range(100):
        setup.outbox.wait(setup.relay.step())
        if not setup.outbox.attempts():
            break
    assert setup.plane.arrived("att-1") == ["shard:1:0", "shard:2:0", "shard:3:0"]


def test_unknown_attempt_and_401(setup: Setup) -> None:
    waiter = setup.outbox.put("att-9", "shard", shard(1, 0), wait=True)
    setup.relay.step()
    assert waiter is not None and waiter.wait(0) and waiter.status == HTTPStatus.CONFLICT
    setup.plane.forget_nodes()
    setup.outbox.put("att-1", "event", event("kept"))
    setup.relay.step()
    assert setup.unauthorized and setup.outbox.pending("att-1") == 1


def test_a_busy_control_plane_is_asked_again_after_its_retry_after(setup: Setup) -> None:
    """A 503 with Retry-After (the control plane's bookkeeping gate, control_plane/lanes.py): the relay
    keeps the items and tries again no sooner than it was told, with jitter on top."""
    setup.plane.busy_reports["att-1"] = 3
    setup.outbox.put("att-1", "shard", shard(10, 0))
    asked = time.monotonic()
    setup.relay.step()
    assert setup.plane.busy_answered == 1 and setup.relay.failed_sends == 1
    assert 3.0 <= setup.relay._next_try_at["att-1"] - asked <= 4.6
    setup.relay.step()
    assert setup.plane.busy_answered == 1  # not before it is due
    del setup.plane.busy_reports["att-1"]
    setup.relay._next_try_at.clear()  # as if the wait had passed
    setup.drain()
    assert setup.plane.arrived("att-1") == ["shard:10:0"]


def test_the_client_waits_out_a_retry_after_between_its_own_tries() -> None:
    plane = FakeControlPlane().start()
    client = ControlPlaneClient(plane.url, join_token=plane.join_token, retry=RetryPolicy(attempts=2), timeout_s=2)
    try:
        client.register(RegisterRequest(name="n", address="127.0.0.1",
                                        gpus=[GpuInfo(index=0, uuid="u", kind="k", memory_mb=0)]))
        plane.busy_reports["att-1"] = 1
        began = time.monotonic()
        with pytest.raises(ControlPlaneUnavailable) as raised:
            client.report_shards("att-1", ShardReport(fencing_token="f", node_rank=0, shards=[shard(10, 0)]))
        assert plane.busy_answered == 2 and time.monotonic() - began >= 1.0
        assert raised.value.retry_after_s == 1.0
    finally:
        client.close()
        plane.stop()
