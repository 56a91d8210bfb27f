"""The local API for workers, over real HTTP on real unix sockets."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http import HTTPStatus
from pathlib import Path

import httpx
import pytest

from node_agent.confinement.isolation import Confinement, worker_paths
from node_agent.link.outbox import DROPPED_EVENT, Outbox
from node_agent.local.api import LocalApi, LocalApiLimits, LocalReports
from tests.helpers import wait_for
from trainyard.protocol.agent import LocalProgress, LocalReady, ShardInfo, WorkerEvent
from trainyard.protocol.grants import LocalStorageRequest


@pytest.fixture
def sockets() -> Iterator[Path]:
    # Short: a unix socket path holds at most 107 bytes, and pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="la-", dir="/tmp") as directory:
        yield Path(directory)


def serve(sockets: Path, attempt_id: str = "att-1", **kwargs: object) -> LocalApi:
    api = LocalApi(**kwargs)  # type: ignore[arg-type]
    api.reports.register(attempt_id, "fence-1")
    api.open(attempt_id, sockets / f"{attempt_id}.0.sock")
    return api


@pytest.fixture
def api(sockets: Path) -> Iterator[LocalApi]:
    api = serve(sockets)
    try:
        yield api
    finally:
        api.stop()
        api.stop()  # idempotent


def client(api: LocalApi, attempt_id: str = "att-1") -> httpx.Client:
    path = api.socket_of(attempt_id)
    assert path is not None
    return httpx.Client(base_url="http://agent", transport=httpx.HTTPTransport(uds=str(path)), timeout=5)


def post(api: LocalApi, attempt_id: str, kind: str, body: dict[str, object], via: str = "att-1") -> httpx.Response:
    with client(api, via) as http:  # ASCII JSON: a lone surrogate goes as its escape
        return http.post(f"/v1/local/attempts/{attempt_id}/{kind}", content=json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})


def raw(path: Path, data: bytes, timeout: float = 5.0) -> bytes:
    """Send bytes on a fresh connection and read the answer until the server closes it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered before it all went
            sock.sendall(data)
        answer = b""
        with contextlib.suppress(ConnectionResetError):  # closed with our request unread: answered
            while chunk := sock.recv(65536):
                answer += chunk
        return answer


def test_each_attempt_has_its_own_private_socket(api: LocalApi, sockets: Path) -> None:
    path = api.socket_of("att-1")
    assert path is not None and stat.S_ISSOCK(path.stat().st_mode)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # no one but its owner connects
    with client(api) as http:
        assert http.get("/healthz").json() == {"ok": True}
    # The socket answers for its own attempt only, whatever token is shown.
    api.reports.register("att-2", "fence-2")
    resp = post(api, "att-2", "progress", {"fencing_token": "fence-2", "rank": 0, "step": 1})
    assert resp.status_code == 403 and api.reports.snapshot("att-2") == (None, None)
    api.close("att-1")
    assert not path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to another uid")
def test_another_uid_cannot_connect_and_the_attempt_uid_can(sockets: Path) -> None:
    sockets.chmod(0o711)
    api = LocalApi()
    api.reports.register("att-1", "fence-1")
    path = sockets / "att-1.0.sock"
    api.open("att-1", path, uid=20101, gid=20101)
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1])\n"
            "except PermissionError:\n    print('refused')\nelse:\n    print('connected')")
    try:
        assert path.stat().st_uid == 20101
        for uid, expected in ((20102, "refused"), (20101, "connected")):
            # Confined like a worker (the interpreter may sit under a private /root: it is exposed).
            confined = Confinement(uid=uid, gid=uid, expose=worker_paths(os.getcwd()))
            command = confined.wrap([sys.executable, "-I", "-S", "-c", code, str(path)])
            done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
            assert done.stdout.strip() == expected, done.stderr
    finally:
        api.stop()


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
        post(api, "att-1", "progress", {**body, "fencing_token": "old"}),
        post(api, "att-1", "progress", {**body, "fencing_token": "fence-1\u00e9"}),
        post(api, "att-1", "result", {"fencing_token": "old", "rank": 0, "result": {}}),
    ):
        assert resp.status_code == 409
        assert resp.headers["content-type"] == "application/problem+json"
        assert resp.json()["status"] == 409
    # Not even UTF-8: refused as a bad body, never a 500 from the comparison.
    assert post(api, "att-1", "progress", {**body, "fencing_token": "fence-\ud800"}).status_code == 422
    api.reports.unregister("att-1")
    assert post(api, "att-1", "progress", body).status_code == 409
    assert api.reports.snapshot("att-1") == (None, None)


def test_invalid_body_is_422_and_unknown_route_404(api: LocalApi) -> None:
    resp = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": -1})
    assert resp.status_code == 422 and resp.json()["errors"]
    with client(api) as http:
        bad_json = http.post("/v1/local/attempts/att-1/result", content=b"{nope")
    assert bad_json.status_code == 422
    assert post(api, "att-1", "other", {}).status_code == 404


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
@pytest.mark.parametrize("kind", ["progress", "result", "events"])
def test_numbers_that_are_not_finite_are_refused_anywhere_in_a_body(api: LocalApi, number: bytes, kind: str) -> None:
    """Finding 7: a NaN accepted here made every later status report of the node unsendable."""
    bodies = {
        "progress": b'{"fencing_token": "fence-1", "rank": 0, "step": 3, "loss": %s}',
        "result": b'{"fencing_token": "fence-1", "rank": 0, "result": {"a": [1, {"b": %s}]}}',
        "events": b'{"fencing_token": "fence-1", "rank": 0, "kind": "x", "message": "m", "data": {"v": %s}}',
    }
    with client(api) as http:
        resp = http.post(f"/v1/local/attempts/att-1/{kind}", content=bodies[kind] % number,
                         headers={"Content-Type": "application/json"})
    assert resp.status_code == 422, resp.text
    assert "finite" in resp.json()["detail"] or "JSON" in resp.json()["detail"]
    assert api.reports.snapshot("att-1") == (None, None) and api.outbox.pending("att-1") == 0


@pytest.mark.parametrize(
    ("length", "status"),
    [(None, 411), ("-1", 400), ("1e3", 400), ("12abc", 400), ("+5", 400), ("\u0661\u0662", 400),
     (str(2**63), 413), (str(64 * 1024 + 1), 413)],
)
def test_a_body_needs_a_bounded_content_length(sockets: Path, length: str | None, status: int) -> None:
    api = serve(sockets, limits=LocalApiLimits(max_body=64 * 1024))
    path = api.socket_of("att-1")
    assert path is not None
    try:
        header = b"" if length is None else b"Content-Length: " + length.encode() + b"\r\n"
        answer = raw(path, b"POST /v1/local/attempts/att-1/progress HTTP/1.1\r\nHost: a\r\n" + header + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
        assert api.reports.snapshot("att-1") == (None, None)
    finally:
        api.stop()


def test_a_chunked_body_is_refused(api: LocalApi) -> None:
    path = api.socket_of("att-1")
    assert path is not None
    answer = raw(path, b"POST /v1/local/attempts/att-1/progress HTTP/1.1\r\nHost: a\r\n"
                       b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 411 ")


def test_a_slow_or_silent_sender_is_cut_off_at_the_request_timeout(sockets: Path) -> None:
    api = serve(sockets, limits=LocalApiLimits(request_timeout_s=0.5))
    path = api.socket_of("att-1")
    assert path is not None
    try:
        for partial in (b"", b"POST /v1/local/attempts/att-1/progress HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(10)
                sock.connect(str(path))
                started = time.monotonic()
                for byte in partial:  # a byte at a time, never finishing
                    sock.sendall(bytes([byte]))
                    time.sleep(0.001)
                assert sock.recv(1024) == b""  # closed by the agent, not answered
                assert time.monotonic() - started < 5
        with client(api) as http:  # and the API still answers
            assert http.get("/healthz").status_code == 200
    finally:
        api.stop()


def test_connections_are_capped_per_attempt_and_other_attempts_still_get_through(sockets: Path) -> None:
    api = serve(sockets, limits=LocalApiLimits(connections_per_attempt=2, connections_total=3, request_timeout_s=5))
    api.reports.register("att-2", "fence-1")
    api.open("att-2", sockets / "att-2.0.sock")
    path = api.socket_of("att-1")
    assert path is not None
    held = []
    try:
        for _ in range(2):  # two idle connections: all att-1 may have
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            held.append(sock)
        wait_for(lambda: api.serving("att-1") == 2, timeout=10, what="both connections taken in")
        assert raw(path, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").startswith(b"HTTP/1.1 503 ")
        with client(api, "att-2") as http:  # another attempt is not held up
            assert http.get("/healthz").status_code == 200
    finally:
        for sock in held:
            sock.close()
        api.stop()


class _HeldSlots:
    """A slot relay whose control plane keeps every request waiting (a long poll) until released."""

    def __init__(self) -> None:
        self.asked = 0
        self.answer = threading.Event()

    def ask(self, attempt_id: str, body: object) -> tuple[HTTPStatus, dict[str, object]]:
        self.asked += 1
        self.answer.wait(10)
        return HTTPStatus.OK, {"slot_id": "s", "state": "waiting", "position": 1, "ttl_s": 0.0}


def test_every_rank_of_a_part_may_wait_for_a_slot_and_the_part_still_reports(sockets: Path) -> None:
    """Each rank of a part holds a connection while it waits for its upload slot (up to
    upload_slot_poll_s): a part of more ranks than connections_per_attempt must not lock itself out.
    The cap grows by connections_per_rank per rank of the part, and still holds beyond that."""
    relay = _HeldSlots()
    limits = LocalApiLimits(connections_per_attempt=2, connections_per_rank=2, connections_total=2,
                            request_timeout_s=5)
    api = LocalApi(limits=limits, slots=relay)  # type: ignore[arg-type]
    api.reports.register("att-1", "fence-1")
    ranks = 5
    api.open("att-1", sockets / "att-1.0.sock", ranks=ranks)
    path = api.socket_of("att-1")
    assert path is not None
    answers: list[int] = []
    body = {"fencing_token": "fence-1", "step": 3, "size_bytes": 10, "wait_s": 10.0}
    waiters = [threading.Thread(target=lambda r=r: answers.append(
        post(api, "att-1", "upload-slot", {**body, "rank": r}).status_code)) for r in range(2 * ranks)]
    held: list[socket.socket] = []
    try:
        api.reports.register("att-2", "fence-2")  # slots only for the socket's own attempt
        other = post(api, "att-2", "upload-slot", {**body, "fencing_token": "fence-2", "rank": 0})
        assert other.status_code == 403 and relay.asked == 0
        for t in waiters:
            t.start()
        wait_for(lambda: relay.asked == 2 * ranks, timeout=10, what="every rank's two polls waiting")
        progress = post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": 1})
        assert progress.status_code == 200, progress.text  # more waits than connections_per_attempt
        for _ in range(limits.connections_per_attempt):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            held.append(sock)
        wait_for(lambda: api.serving("att-1") == 2 * ranks + limits.connections_per_attempt, timeout=10,
                 what="every connection taken in")
        assert raw(path, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n").startswith(b"HTTP/1.1 503 ")
        relay.answer.set()
        for t in waiters:
            t.join(10)
        assert answers == [200] * 2 * ranks
    finally:
        relay.answer.set()
        for sock in held:
            sock.close()
        api.close("att-1")
        assert api.active.limit == limits.connections_total  # the part's share goes with it
        api.stop()


def test_constant_time_token_check_is_on_bytes() -> None:
    from node_agent.local.api import LocalReports

    reports = LocalReports()
    reports.register("a", "t\u00f6ken")
    assert reports.accepts("a", "t\u00f6ken")
    assert not reports.accepts("a", "t\ud800ken") and not reports.accepts("a", "token")
    assert not reports.accepts("b", "x")


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
        post(api, "att-1", "shards", shard(20, token="old")),
        post(api, "att-1", "events", event("checkpoint.fallback", token="old")),
    ):
        assert resp.status_code == 409
        assert resp.headers["content-type"] == "application/problem+json"
    api.reports.unregister("att-1")
    assert post(api, "att-1", "shards?wait=1", shard(20)).status_code == 409
    api.reports.register("att-1", "fence-1")
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


def test_wait_answers_each_outcome(sockets: Path) -> None:
    api = serve(sockets, shard_wait_s=0.3)
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
    outbox = Outbox(max_items=4, max_batch=2)
    waiter = outbox.put("a", "event", WorkerEvent(rank=0, kind="first", message=""), wait=True)
    for i in range(4):
        outbox.put("a", "event", WorkerEvent(rank=0, kind=f"e{i}", message=""))
    assert waiter is not None and waiter.wait(0) and waiter.status == HTTPStatus.SERVICE_UNAVAILABLE
    kinds = lambda batch: [i.body.model_dump()["kind"] for i in batch.items]  # noqa: E731
    batch = outbox.next_batch("a")
    # first and e0 went; a notice of the agent's own says so, in their place in the order.
    assert batch is not None and kinds(batch) == ["e1", "e2"]
    outbox.put("a", "event", WorkerEvent(rank=0, kind="e4", message=""))  # e1, in flight, overflows
    outbox.settle(batch, HTTPStatus.OK, {})
    rest = outbox.next_batch("a")
    # The notice sits where the first drop happened, before what was queued after it.
    assert rest is not None and kinds(rest) == [DROPPED_EVENT, "e3"]
    notice = rest.items[0].body
    assert isinstance(notice, WorkerEvent) and notice.data["events"] == 3 and notice.data["shards"] == 0
    assert outbox.close() == 3
    closed = outbox.put("a", "shard", ShardInfo(rank=0, step=1, world_size=1, key="k", size_bytes=0, sha256=SHA),
                        wait=True)
    assert closed is not None and closed.status == HTTPStatus.SERVICE_UNAVAILABLE


def test_every_rank_feeds_the_node_summary_and_rank_zero_the_progress(api: LocalApi) -> None:
    # Ranks 2 and 3 of this node report steps and timings; only global rank 0 speaks for the attempt.
    for rank, step, busy in [(2, 10, 0.1), (3, 10, 0.3), (2, 20, 0.1)]:
        body = {"fencing_token": "fence-1", "rank": rank, "step": step, "step_time_s": 0.5, "busy_s": busy}
        assert post(api, "att-1", "progress", body).status_code == 200
    assert api.reports.snapshot("att-1") == (None, None)
    time.sleep(0.05)
    summary = api.reports.rank_summary("att-1")
    assert summary is not None
    by_rank = {r.rank: r for r in summary.ranks}
    assert sorted(by_rank) == [2, 3] and by_rank[2].step == 20 and by_rank[3].busy_s == 0.3
    assert by_rank[3].stalled_s >= by_rank[2].stalled_s > 0 and by_rank[3].silent_s > 0
    assert post(api, "att-1", "progress", {"fencing_token": "fence-1", "rank": 0, "step": 3}).status_code == 200
    progress, _ = api.reports.snapshot("att-1")
    assert progress is not None and progress.step == 3
    assert api.reports.rank_summary("att-2") is None


def test_checkpoint_interval_is_served_to_the_attempts_workers(api: LocalApi, sockets: Path) -> None:
    ask = {"fencing_token": "fence-1"}
    assert post(api, "att-1", "checkpoint-interval", ask).json() == {"interval_steps": None}
    api.reports.set_checkpoint_interval("att-1", 40)
    api.reports.set_checkpoint_interval("att-1", None)  # an answer without one keeps the last
    assert post(api, "att-1", "checkpoint-interval", ask).json() == {"interval_steps": 40}
    assert post(api, "att-1", "checkpoint-interval", {"fencing_token": "old"}).status_code == 409
    assert post(api, "att-1", "checkpoint-interval", {}).status_code == 422
    # Another attempt's socket does not answer for this one, even with its token.
    api.reports.register("att-2", "fence-2")
    api.open("att-2", sockets / "att-2.0.sock")
    assert post(api, "att-1", "checkpoint-interval", ask, via="att-2").status_code == 403
    assert post(api, "att-2", "checkpoint-interval", {"fencing_token": "fence-2"}, via="att-2").json() == {
        "interval_steps": None}


def test_storage_requests_are_fenced_and_forwarded_as_answered(sockets: Path) -> None:
    """A worker's request for presigned URLs (issue 11, finding 3) is forwarded only with its
    attempt's fencing token, and answered with the control plane's answer, refusals included."""
    forwarded: list[tuple[str, LocalStorageRequest]] = []
    answers = iter([(HTTPStatus.OK, {"grants": []}),
                    (HTTPStatus.FORBIDDEN, {"detail": "not yours", "type": "https://trainyard.dev/problems/forbidden"})])

    def forward(attempt_id: str, body: LocalStorageRequest) -> tuple[HTTPStatus, dict[str, object]]:
        forwarded.append((attempt_id, body))
        return next(answers)

    api = serve(sockets, grants=forward)
    body = {"fencing_token": "fence-1", "rank": 1, "method": "PUT", "key": "jobs/j/checkpoints/x", "size_bytes": 3}
    try:
        assert post(api, "att-1", "storage", {**body, "fencing_token": "old"}).status_code == 409
        assert post(api, "att-2", "storage", body).status_code == 403  # another attempt's: not on this socket
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
    bare = serve(sockets, "att-3")
    try:
        assert post(bare, "att-3", "storage", body, via="att-3").status_code == 503
    finally:
        bare.stop()


def _shard(step: int) -> ShardInfo:
    return ShardInfo(rank=1, step=step, world_size=2, key=f"jobs/j/step-{step}/rank-1", size_bytes=1, sha256=SHA)


def test_outbox_is_bounded_in_bytes_events_go_before_shards_and_a_notice_counts_them() -> None:
    """Finding 9: 10,000 items of 1 MiB per attempt were allowed; now a byte budget, events first."""
    big = "x" * 3000
    outbox = Outbox(max_bytes=20_000)
    for step in range(10):
        outbox.put("a", "shard", _shard(step))
    for i in range(8):
        outbox.put("a", "event", WorkerEvent(rank=0, kind="note", message=big, data={"i": i}))
    outbox.put("b", "event", WorkerEvent(rank=0, kind="note", message=big))  # another attempt's budget
    items = []
    while (batch := outbox.next_batch("a")) is not None:
        items += batch.items
        outbox.settle(batch, HTTPStatus.OK, {})
    assert sum(i.size for i in items) <= 20_000
    shards = [i.body.step for i in items if i.kind == "shard"]
    assert shards == list(range(10))  # every shard kept: only events were dropped
    events = [i.body for i in items if i.kind == "event"]
    notice = next(e for e in events if e.kind == DROPPED_EVENT)
    kept = [e.data["i"] for e in events if e.kind == "note"]
    assert kept == list(range(8 - len(kept), 8))  # the newest kept, the oldest dropped
    assert notice.data["events"] == 8 - len(kept) > 0 and notice.data["shards"] == 0
    assert outbox.pending("b") == 1
    # Only shards left to drop: the oldest shard goes, and a new notice says so.
    small = Outbox(max_bytes=2_000)
    for step in range(20):
        small.put("a", "shard", _shard(step))
    items = []
    while (batch := small.next_batch("a")) is not None:
        items += batch.items
        small.settle(batch, HTTPStatus.OK, {})
    steps = [i.body.step for i in items if i.kind == "shard"]
    assert steps == list(range(steps[0], 20)) and steps[0] > 0  # the newest, in order
    notices = [i.body for i in items if i.kind == "event"]
    assert [n.kind for n in notices] == [DROPPED_EVENT] and notices[0].data["shards"] == steps[0]


def test_a_worker_waits_out_a_control_plane_outage_for_its_storage_grant(sockets: Path) -> None:
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

    api = serve(sockets, grants=forward)
    path = str(api.socket_of("att-1"))
    try:
        source = AgentGrants(agent_url="http://agent", attempt_id="att-1", fencing_token="fence-1", rank=0,
                             timeout_s=5, wait_s=30, backoff_s=0.2, max_backoff_s=0.5, agent_socket=path)
        assert source.grants("PUT", "jobs/j/checkpoints/x", size_bytes=3).grants == []
        assert calls[-1] >= down_until and len(calls) >= 4
        n = len(calls)
        with pytest.raises(GrantRefused):
            source.grants("PUT", "jobs/j/checkpoints/stale", size_bytes=3)
        assert len(calls) == n + 1
        impatient = AgentGrants(agent_url="http://agent", attempt_id="att-1", fencing_token="fence-1", rank=0,
                                timeout_s=5, wait_s=0.5, backoff_s=0.2, max_backoff_s=0.2, agent_socket=path)
        down_until = time.monotonic() + 60
        with pytest.raises(OSError, match="HTTP 503"):
            impatient.grants("GET", "jobs/j/checkpoints/x")
    finally:
        api.stop()


def test_the_part_is_initialised_when_its_last_rank_says_ready(api: LocalApi) -> None:
    assert api.reports.initialized_at("att-1", 2) is None
    assert post(api, "att-1", "ready", {"fencing_token": "fence-1", "rank": 4}).status_code == 200
    assert api.reports.initialized_at("att-1", 2) is None  # one of two ranks
    first = api.reports.initialized_at("att-1", 1)
    time.sleep(0.01)
    assert post(api, "att-1", "ready", {"fencing_token": "fence-1", "rank": 5}).status_code == 200
    last = api.reports.initialized_at("att-1", 2)
    assert first is not None and last is not None and last > first
    # Said again (a re-initialised group): the first instant stands.
    assert post(api, "att-1", "ready", {"fencing_token": "fence-1", "rank": 5}).status_code == 200
    assert api.reports.initialized_at("att-1", 2) == last
    stale = post(api, "att-1", "ready", {"fencing_token": "old", "rank": 6})
    assert stale.status_code == 409 and api.reports.initialized_at("att-1", 3) is None
    assert post(api, "att-1", "ready", {"fencing_token": "fence-1", "rank": -1}).status_code == 422


def test_the_first_step_and_each_ready_wake_the_report_loop_and_every_rank_stepped_is_known() -> None:
    """The report loop sends a recovery's rendezvous and first step when they happen, not at its
    next pass (issue 30); the standbys that replace those a part took wait until each of its ranks
    has stepped (LocalReports.stepped)."""
    woken: list[int] = []
    reports = LocalReports(on_ready=lambda: woken.append(1))
    reports.register("att-1", "fence-1")
    assert not reports.stepped("att-1", 2) and not reports.stepped("unknown", 0)
    assert reports.set_ready("att-1", LocalReady(fencing_token="fence-1", rank=0)) and len(woken) == 1
    assert reports.add_progress("att-1", LocalProgress(fencing_token="fence-1", rank=1, step=5))
    assert len(woken) == 1 and not reports.stepped("att-1", 2)  # another rank's step: not the attempt's progress
    assert reports.add_progress("att-1", LocalProgress(fencing_token="fence-1", rank=0, step=5, loss=1.0))
    assert len(woken) == 2 and reports.stepped("att-1", 2)  # the attempt's first step
    assert reports.add_progress("att-1", LocalProgress(fencing_token="fence-1", rank=0, step=6, loss=0.9))
    assert len(woken) == 2  # later steps ride on the next pass
    assert not reports.add_progress("att-1", LocalProgress(fencing_token="stale", rank=0, step=7, loss=0.8))
