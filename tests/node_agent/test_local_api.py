"""The local API for workers, over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus

import httpx
import pytest

from node_agent.local_api import LocalApi
from node_agent.relay import Outbox
from trainyard.protocol.agent import ShardInfo, WorkerEvent
from trainyard.protocol.grants import LocalStorageRequest


@pytest.fixture
def api() -> Iterator[LocalApi]:
    api = LocalApi("127.0.0.2", 0)
    api.start()
    api.reports.register("att-1", "fence-1")
    try:
        yield api
    finally:
        api.stop()
        api.stop()  # idempotent


def post(api: LocalApi, attempt_id: str, kind: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/local/attempts/{attempt_id}/{kind}", json=body, timeout=5)


def test_url_is_on_the_agent_address(api: LocalApi) -> None:
    assert api.url.startswith("http://127.0.0.2:")
    assert httpx.get(f"{api.url}/healthz").json() == {"ok": True}


def test_progress_keeps_the_highest_step(api: LocalApi) -> None:
    for step, loss in [(5, 0.5), (7, 0.4), (6, 0.45)]:
        resp = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": step, "loss": loss})
        assert resp.status_code == 200, resp.text
    progress, result = api.reports.snapshot("att-1")
    assert progress is not None and progress.step == 7 and progress.loss == 0.4
    assert result is None


def test_result_prefers_rank_zero(api: LocalApi) -> None:
    assert post(api, "att-1", "result", {"fencing_token": "fence-1", "rank": 0, "result": {"x": 0}}).status_code == 200
    assert post(api, "att-1", "result", {"fencing_token": "fence-1", "rank": 1, "result": {"x": 1}}).status_code == 200
    assert api.reports.snapshot("att-1")[1] == {"x": 0}


def test_unknown_attempt_and_wrong_token_are_409(api: LocalApi) -> None:
    body = {"fencing_token": "fence-1", "rank": 0, "step": 1}
    for resp in (
        post(api, "att-2", "progress", body),
        post(api, "att-1", "progress", {**body, "fencing_token": "old"}),
        post(api, "att-1", "result", {"fencing_token": "old", "rank": 0, "result": {}}),
    ):
        assert resp.status_code == 409
        assert resp.headers["content-type"] == "application/problem+json"
        assert resp.json()["status"] == 409
    api.reports.unregister("att-1")
    assert post(api, "att-1", "progress", body).status_code == 409
    assert api.reports.snapshot("att-1") == (None, None)


def test_invalid_body_is_422_and_unknown_route_404(api: LocalApi) -> None:
    resp = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": -1})
    assert resp.status_code == 422 and resp.json()["errors"]
    bad_json = httpx.post(f"{api.url}/v1/local/attempts/att-1/result", content=b"{nope", timeout=5)
    assert bad_json.status_code == 422
    assert post(api, "att-1", "other", {}).status_code == 404


SHA = "ab" * 32


def shard(step: int, rank: int = 0, token: str = "fence-1") -> dict[str, object]:
    key = f"jobs/j/checkpoints/step-{step:09d}/attempt-0001/rank-{rank}"
    return {"fencing_token": token, "rank": rank, "step": step, "world_size": 2, "key": key,
            "size_bytes": 10, "sha256": SHA}


def event(kind: str, token: str = "fence-1") -> dict[str, object]:
    return {"fencing_token": token, "rank": 0, "kind": kind, "message": f"{kind} happened", "data": {"step": 1}}


def test_shards_and_events_are_queued_in_order_and_fenced(api: LocalApi) -> None:
    for kind, body in [("events", event("checkpoint.restored")), ("shards", shard(10)), ("shards", shard(10, 1))]:
        resp = post(api, "att-1", kind, body)
        assert resp.status_code == 202 and resp.json() == {"accepted": True, "queued": True}
    for resp in (
        post(api, "att-2", "shards", shard(20)),
        post(api, "att-1", "shards", shard(20, token="old")),
        post(api, "att-1", "events", event("checkpoint.fallback", token="old")),
        post(api, "att-2", "shards?wait=1", shard(20)),
    ):
        assert resp.status_code == 409
        assert resp.headers["content-type"] == "application/problem+json"
    assert post(api, "att-1", "shards", {**shard(30), "sha256": "nope"}).status_code == 422
    assert post(api, "att-1", "events", {**event("x"), "kind": "Bad Kind"}).status_code == 422
    first = api.outbox.next_batch("att-1")
    assert first is not None and first.kind == "event"
    (item,) = first.items
    assert item.body.model_dump()["at"] is not None  # stamped when queued: it may be delivered much later
    api.outbox.settle(first, HTTPStatus.OK, {"accepted": 1})
    second = api.outbox.next_batch("att-1")
    assert second is not None and second.kind == "shard"
    assert [(i.body.model_dump()["step"], i.body.rank) for i in second.items] == [(10, 0), (10, 1)]
    assert not hasattr(second.items[0].body, "fencing_token")
    assert api.outbox.pending("att-1") == 2 and api.outbox.attempts() == ["att-1"]


def test_wait_returns_the_control_plane_ack(api: LocalApi) -> None:
    def control_plane() -> None:
        deadline = time.monotonic() + 5
        while (batch := api.outbox.next_batch("att-1")) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batch is not None
        api.outbox.settle(batch, HTTPStatus.OK, {"accepted": len(batch), "committed_steps": [10]})

    thread = threading.Thread(target=control_plane)
    thread.start()
    resp = post(api, "att-1", "shards?wait=1", shard(10))
    thread.join()
    assert resp.status_code == 200 and resp.json() == {"accepted": 1, "committed_steps": [10]}


def test_wait_answers_each_outcome() -> None:
    api = LocalApi("127.0.0.2", 0, shard_wait_s=0.3)
    api.start()
    api.reports.register("att-1", "fence-1")
    try:
        resp = post(api, "att-1", "shards?wait=1", shard(10))  # nobody relays it
        assert resp.status_code == 504 and "stays queued" in resp.json()["detail"]
        assert api.outbox.pending("att-1") == 1

        def later(action: Callable[[], object]) -> threading.Thread:
            def run() -> None:
                while api.outbox.pending("att-1") < 2:
                    time.sleep(0.01)
                action()

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        thread = later(lambda: api.outbox.drop("att-1", HTTPStatus.CONFLICT, "stale attempt: fenced"))
        resp = post(api, "att-1", "shards?wait=1", shard(20))
        thread.join()
        assert resp.status_code == 409 and resp.json()["detail"] == "stale attempt: fenced"

        post(api, "att-1", "shards", shard(30))

        def refuse() -> None:
            batch = api.outbox.next_batch("att-1")
            assert batch is not None
            api.outbox.settle(batch, HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": "refused", "upstream_status": 409})

        thread = later(refuse)
        resp = post(api, "att-1", "shards?wait=1", shard(40))
        thread.join()
        assert resp.status_code == 422 and resp.json()["upstream_status"] == 409
    finally:
        api.stop()


def test_outbox_drops_the_oldest_when_full() -> None:
    outbox = Outbox(max_items=3, max_batch=2)
    waiter = outbox.put("a", "event", WorkerEvent(rank=0, kind="first", message=""), wait=True)
    for i in range(4):
        outbox.put("a", "event", WorkerEvent(rank=0, kind=f"e{i}", message=""))
    assert waiter is not None and waiter.wait(0) and waiter.status == HTTPStatus.SERVICE_UNAVAILABLE
    batch = outbox.next_batch("a")
    assert batch is not None and [i.body.model_dump()["kind"] for i in batch.items] == ["e1", "e2"]
    outbox.put("a", "event", WorkerEvent(rank=0, kind="e4", message=""))  # e1, in flight, overflows
    outbox.settle(batch, HTTPStatus.OK, {})
    rest = outbox.next_batch("a")
    assert rest is not None and [i.body.model_dump()["kind"] for i in rest.items] == ["e3", "e4"]
    assert outbox.close() == 2
    closed = outbox.put("a", "shard", ShardInfo(rank=0, step=1, world_size=1, key="k", size_bytes=0, sha256=SHA),
                        wait=True)
    assert closed is not None and closed.status == HTTPStatus.SERVICE_UNAVAILABLE


def test_storage_requests_are_fenced_and_forwarded_as_answered() -> None:
    """A worker's request for presigned URLs (issue 11, finding 3) is forwarded only with its
    attempt's fencing token, and answered with the control plane's answer, refusals included."""
    forwarded: list[tuple[str, LocalStorageRequest]] = []
    answers = iter([(HTTPStatus.OK, {"grants": []}),
                    (HTTPStatus.FORBIDDEN, {"detail": "not yours", "type": "https://trainyard.dev/problems/forbidden"})])

    def forward(attempt_id: str, body: LocalStorageRequest) -> tuple[HTTPStatus, dict[str, object]]:
        forwarded.append((attempt_id, body))
        return next(answers)

    api = LocalApi("127.0.0.2", 0, grants=forward)
    api.start()
    api.reports.register("att-1", "fence-1")
    body = {"fencing_token": "fence-1", "rank": 1, "method": "PUT", "key": "jobs/j/checkpoints/x", "size_bytes": 3}
    try:
        assert post(api, "att-1", "storage", {**body, "fencing_token": "old"}).status_code == 409
        assert post(api, "att-2", "storage", body).status_code == 409
        assert post(api, "att-1", "storage", {**body, "size_bytes": None}).status_code == 422  # a PUT needs a size
        assert forwarded == []
        ok = post(api, "att-1", "storage", body)
        assert ok.status_code == 200 and ok.json() == {"grants": []}
        refused = post(api, "att-1", "storage", body)
        assert refused.status_code == 403 and refused.json()["detail"] == "not yours"
        assert refused.json()["type"].endswith("/forbidden")
        assert [(a, b.rank, b.key, b.size_bytes) for a, b in forwarded] == [("att-1", 1, body["key"], 3)] * 2
    finally:
        api.stop()
    bare = LocalApi("127.0.0.2", 0)
    bare.start()
    bare.reports.register("att-1", "fence-1")
    try:
        assert post(bare, "att-1", "storage", body).status_code == 503
    finally:
        bare.stop()


def test_a_worker_waits_out_a_control_plane_outage_for_its_storage_grant() -> None:
    """A checkpoint that falls into a control plane restart or a database failover is delayed, not
    lost: the worker asks its agent again while the agent answers 503, and gets the grant once the
    control plane is back (on the commit that introduced presigned storage, three tries in 1.5 s
    gave up, and the e2e restarts lost the first checkpoint). A refusal is never retried."""
    from worker_runtime.checkpoint.presigned import AgentGrants, GrantRefused

    down_until = time.monotonic() + 2.5
    calls: list[float] = []

    def forward(attempt_id: str, body: LocalStorageRequest) -> tuple[HTTPStatus, dict[str, object]]:
        calls.append(time.monotonic())
        if body.key.endswith("/stale"):
            return HTTPStatus.CONFLICT, {"detail": "attempt att-1 is fenced off"}
        if time.monotonic() < down_until:
            return HTTPStatus.SERVICE_UNAVAILABLE, {"detail": "the control plane is not reachable"}
        return HTTPStatus.OK, {"grants": []}

    api = LocalApi("127.0.0.2", 0, grants=forward)
    api.start()
    api.reports.register("att-1", "fence-1")
    try:
        source = AgentGrants(agent_url=api.url, attempt_id="att-1", fencing_token="fence-1", rank=0,
                             timeout_s=5, wait_s=30, backoff_s=0.2, max_backoff_s=0.5)
        assert source.grants("PUT", "jobs/j/checkpoints/x", size_bytes=3).grants == []
        assert calls[-1] >= down_until and len(calls) >= 4
        n = len(calls)
        with pytest.raises(GrantRefused):
            source.grants("PUT", "jobs/j/checkpoints/stale", size_bytes=3)
        assert len(calls) == n + 1
        impatient = AgentGrants(agent_url=api.url, attempt_id="att-1", fencing_token="fence-1", rank=0,
                                timeout_s=5, wait_s=0.5, backoff_s=0.2, max_backoff_s=0.2)
        down_until = time.monotonic() + 60
        with pytest.raises(OSError, match="HTTP 503"):
            impatient.grants("GET", "jobs/j/checkpoints/x")
    finally:
        api.stop()
