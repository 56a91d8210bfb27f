"""A node's batch of upload-slot asks and releases, and of storage requests, on real PostgreSQL
(issue 27: a checkpoint costs the control plane a few requests per node, not three per rank;
trainyard/protocol/uploads.py and grants.py, the ``/batch`` paths).

What the batch must keep of the single paths: the limits (8 asks under a limit of 3: 3 granted, 5
queued first come, first served in the asks' order), the long poll (woken as soon as a grant pass
grants any of its asks, by a release in another batch), releases served before the asks of the same
batch, fencing for the whole batch (a stale token: 409 and nothing applied; a rank outside the
world: 422 naming it; another node's rank: 403), and storage requests answered each as the single
path would, one refusal not refusing the others."""

from __future__ import annotations

import io
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import urllib3
from fastapi.testclient import TestClient

from control_plane import failpoints
from control_plane.app import create_app
from control_plane.settings import Settings
from node_agent.link.batcher import WINDOW_S
from node_agent.link.client import ControlPlaneClient, RetryPolicy
from node_agent.link.storage_grants import GrantRelay
from node_agent.link.upload_slots import SlotRelay
from node_agent.local.api import BASE_URL, LocalApi
from tests.control_plane.helpers import serve
from tests.control_plane.test_storage_grants import Job as GrantedJob
from tests.control_plane.test_upload_slots import PROMPTLY_S, Job, _slots
from tests.factories import ADMIN, JOIN_TOKEN, job_body, workers_for
from trainyard.protocol import keys
from trainyard.protocol.agent import HeartbeatRequest, RegisterRequest, WorkerEventBatch
from worker_runtime import WorkerContext
from worker_runtime.checkpoint.presigned import AgentGrants, PresignedStorage
from worker_runtime.checkpoint.slots import UploadSlots

HTTP = urllib3.PoolManager(retries=False)


def _batch(c: TestClient, job: Job, *, asks: Sequence[int] = (), releases: Sequence[int] = (), step: int = 10,
           wait_s: float = 0.0, node: int = 0, token: str | None = None) -> Any:
    spec = job.specs[node]
    return c.post(f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots/batch", headers=job.auth[node], json={
        "fencing_token": token or spec["fencing_token"], "node_rank": spec["node_rank"], "wait_s": wait_s,
        "asks": [{"rank": r, "step": step, "size_bytes": 1000} for r in asks],
        "releases": [{"rank": r, "step": step, "ok": True, "uploaded_bytes": 1000, "upload_s": 0.5} for r in releases],
    })


def _states(c: TestClient, job: Job) -> dict[int, str]:
    return {s["rank"]: s["state"] for s in _slots(c, job.id)["slots"] if s["state"] in ("waiting", "granted")}


def test_a_batch_of_8_asks_under_a_limit_of_3_grants_3_and_queues_5_and_releases_wake_its_long_poll(
        settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"upload_slots_max": 3}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=8)
        order = [5, 3, 7, 0, 6, 1, 4, 2]  # the asks' order, not the ranks': first come, first served
        started = time.monotonic()
        r = _batch(c, job, asks=order, wait_s=PROMPTLY_S)
        assert r.status_code == 200, r.text
        answers = r.json()["answers"]
        # All eight waited for a pass; its grants woke the long poll well before wait_s.
        assert time.monotonic() - started < PROMPTLY_S
        assert [(a["rank"], a["step"]) for a in answers] == [(rank, 10) for rank in order]
        assert [a["state"] for a in answers] == ["granted"] * 3 + ["waiting"] * 5
        assert [a["position"] for a in answers] == [0, 0, 0, 0, 1, 2, 3, 4]
        assert all(a["retry_after_s"] == 0 for a in answers)  # a long poll: the waiting ask again at once
        assert r.json()["released"] == []
        view = _slots(c, job.id)
        assert (view["granted"], view["waiting"]) == (3, 5)

        # The five waiters hold one long poll together; a release in another batch wakes it.
        polled: dict[str, Any] = {}
        waiting = order[3:]
        poll = threading.Thread(target=lambda: polled.update(
            _batch(c, job, asks=waiting, wait_s=45).json()), daemon=True)
        poll.start()
        deadline = time.monotonic() + PROMPTLY_S
        while app.state.slot_wakeups.waiting < 1:
            assert time.monotonic() < deadline, "the batch is not waiting in a long poll"
            time.sleep(0.02)
        assert app.state.slot_wakeups.waiting == 1  # one request held, whatever its asks
        released = _batch(c, job, releases=[5, 3, 3])  # a duplicate: released once
        assert released.status_code == 200, released.text
        assert released.json() == {"answers": [], "released": [True, True, False]}
        poll.join(PROMPTLY_S)
        assert not poll.is_alive(), "the release did not wake the batch's long poll"
        assert [a["rank"] for a in polled["answers"]] == waiting
        assert [a["state"] for a in polled["answers"]] == ["granted"] * 2 + ["waiting"] * 3
        assert _states(c, job) == {7: "granted", 0: "granted", 6: "granted", 1: "waiting", 4: "waiting", 2: "waiting"}

        # A batch's releases are applied before its asks: the capacity they free serves them.
        both = _batch(c, job, releases=[7], asks=[1], wait_s=PROMPTLY_S)
        assert both.status_code == 200, both.text
        assert both.json()["released"] == [True] and both.json()["answers"][0]["state"] == "granted"

        # Asking again renews (granted) or polls (waiting) the same slot, answered at once without
        # waiting when any of them is granted.
        again = _batch(c, job, asks=[0, 4], wait_s=45).json()["answers"]
        assert [a["state"] for a in again] == ["granted", "waiting"]
        assert again[1]["position"] == 0


def test_a_batch_is_fenced_as_a_whole(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"upload_slots_max": 1}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1", "r2"], gpus=2)
        spec = job.specs[1]
        r = c.post(f"/v1/agent/attempts/{spec['attempt_id']}/status", headers=job.auth[1], json={
            "fencing_token": spec["fencing_token"], "node_rank": 1, "state": "running",
            "workers": workers_for(spec, "running")})
        assert r.status_code == 200, r.text
        assert _batch(c, job, asks=[0]).json()["answers"][0]["state"] == "granted"

        stale = _batch(c, job, releases=[0], asks=[1], token="not-the-token")
        assert stale.status_code == 409 and stale.json()["type"].endswith("/stale-attempt")
        assert stale.headers["content-type"].startswith("application/problem+json")
        assert _states(c, job) == {0: "granted"}  # nothing in the refused batch was applied

        outside = _batch(c, job, asks=[1, 4, 9])
        assert outside.status_code == 422 and "[4, 9]" in outside.json()["detail"], outside.text
        theirs = _batch(c, job, asks=[1, 2])  # rank 2 runs on node rank 1
        assert theirs.status_code == 403 and "[2]" in theirs.json()["detail"], theirs.text
        theirs = _batch(c, job, releases=[3])
        assert theirs.status_code == 403, theirs.text
        assert _states(c, job) == {0: "granted"}

        assert _batch(c, job).json() == {"answers": [], "released": []}  # an empty batch is fenced too
        assert _batch(c, job, token="x").status_code == 409
        spec = job.specs[0]
        url = f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots/batch"
        body = {"fencing_token": spec["fencing_token"], "node_rank": 0}
        assert c.post(url, json=body).status_code == 401
        for bad in ({"wait_s": 61}, {"wait_s": -1}, {"asks": [{"rank": 0, "step": 1, "size_bytes": 1}] * 4097},
                    {"asks": [{"rank": -1, "step": 1, "size_bytes": 1}]}, {"releases": [{"rank": 0, "step": 2**31}]},
                    {"asks": "x"}):
            r = c.post(url, headers=job.auth[0], json={**body, **bad})
            assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), bad

        # The attempt ends: asks are refused as stale (409), and a batch of releases is still taken.
        r = c.post(f"/v1/agent/attempts/{spec['attempt_id']}/status", headers=job.auth[0], json={
            "fencing_token": spec["fencing_token"], "node_rank": 0, "state": "exited", "exit_code": 1,
            "workers": workers_for(spec, "exited", 1)})
        assert r.status_code == 200, r.text
        assert _batch(c, job, asks=[1]).status_code == 409
        assert _batch(c, job, releases=[0]).json() == {"answers": [], "released": [True]}


@pytest.fixture
def storage(settings: Settings, s3_bucket: Any) -> Any:
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "storage_part_size_mb": 5,
    })
    with TestClient(create_app(s3)) as c:
        yield c


def test_a_storage_batch_answers_each_request_as_the_single_path_would(storage: TestClient) -> None:
    job = GrantedJob(storage, "batched", nodes=1, gpus=2)
    agent, spec = job.node_of(0)
    job.save(10, 1, b"rank one")  # rank 1's shard of step 10 is reported: it cannot be written again
    url = f"/v1/agent/attempts/{spec['attempt_id']}/storage/batch"

    def batch(requests: list[dict[str, Any]], token: str | None = None) -> Any:
        return storage.post(url, headers=agent.headers, json={
            "fencing_token": token or spec["fencing_token"], "node_rank": spec["node_rank"], "requests": requests})

    mine, theirs = job.shard_key(10, 0), job.shard_key(10, 1)
    requests = [
        {"rank": 0, "method": "PUT", "key": mine, "size_bytes": 8},  # 200
        {"rank": 0, "method": "PUT", "key": theirs, "size_bytes": 8},  # 403: another rank's shard
        {"rank": 1, "method": "PUT", "key": theirs, "size_bytes": 8},  # 409: already reported
        {"rank": 0, "method": "GET", "key": f"{job.prefix}/step-000000005/attempt-0001/manifest.json"},  # 404
        {"rank": 1, "method": "PUT", "key": job.shard_key(20, 1), "size_bytes": 8, "upload_id": "u-1"},  # 422
        {"rank": 1, "method": "PUT", "key": job.shard_key(20, 1), "size_bytes": 8},  # 200
    ]
    r = batch(requests)
    assert r.status_code == 200, r.text
    answers = r.json()["answers"]
    assert [a["status"] for a in answers] == [200, 403, 409, 404, 422, 200], answers
    for answer, request in zip(answers, requests, strict=True):
        if answer["status"] == 200:
            assert answer["detail"] is None
            continue
        assert answer["grants"] is None and answer["detail"] and answer["type"].startswith("https://trainyard.dev/")
        single = storage.post(f"/v1/agent/attempts/{spec['attempt_id']}/storage", headers=agent.headers, json={
            **request, "fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"]})
        assert (single.status_code, single.json()["type"]) == (answer["status"], answer["type"])

    # The granted URLs work: rank 0 creates its own shard, create-only.
    [put] = answers[0]["grants"]["grants"]
    data = b"rank 0!!"
    assert HTTP.request("PUT", put["url"], body=data, headers=put["headers"]).status == 200
    assert HTTP.request("PUT", put["url"], body=data, headers=put["headers"]).status == 412

    # A stale attempt refuses the whole batch; so does a node that does not hold the node rank.
    stale = batch(requests[:1], token="not-the-token")
    assert stale.status_code == 409 and stale.json()["type"].endswith("/stale-attempt")
    assert batch([]).json() == {"answers": []}
    over = batch([requests[0]] * 4097)
    assert over.status_code == 422 and over.headers["content-type"].startswith("application/problem+json")
    assert storage.post(url, json={"fencing_token": "x", "node_rank": 0, "requests": []}).status_code == 401


WAVE_S = 0.25
"""The agent's batch window in the counting test: long enough that this machine's load (two cores
shared with other test sessions) never splits the ranks' requests of one wave, which the agent's
default window (WINDOW_S) did at times here (10 requests for 8 ranks instead of 3 to 6)."""


class CountingClient(ControlPlaneClient):
    """The agent's own client, counting the requests it sends by path (the attempt id left out)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: Counter[str] = Counter()
        self._count = threading.Lock()

    def _post(self, path: str, *args: Any, **kwargs: Any) -> Any:
        with self._count:
            self.sent[path.split("/", 3)[-1] if path.startswith("/attempts/") else path] += 1
        return super()._post(path, *args, **kwargs)


class Node:
    """One node of 8 ranks, through the agent's own relays and local API, on a real control plane."""

    RANKS = 8

    def __init__(self, url: str, app: Any, window_s: float = WINDOW_S) -> None:
        self.client = CountingClient(url, join_token=JOIN_TOKEN, retry=RetryPolicy(attempts=1))
        self.client.register(RegisterRequest.model_validate({"name": "node-0", "address": "127.0.0.1", "gpus": [
            {"index": i, "uuid": f"node-0-{i}", "kind": "virtual-cpu", "memory_mb": 0} for i in range(self.RANKS)]}))
        with httpx.Client(base_url=url) as admin:
            assert admin.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=self.RANKS),
                              headers=ADMIN).status_code == 201
        assert app.state.loops.schedule_once() == 1
        [self.spec] = self.client.heartbeat(HeartbeatRequest(agent_instance="i", seq=1)).assignments
        spec = self.spec
        self.stale: list[str] = []
        self.slots = SlotRelay(self.client, target=lambda a: (spec.fencing_token, spec.node_rank),
                               on_stale=lambda a, exc: self.stale.append(a), on_unauthorized=lambda: None,
                               ranks=lambda a: self.RANKS, window_s=window_s)
        self.grants = GrantRelay(self.client, target=lambda a: spec.node_rank, on_unauthorized=lambda: None,
                                 ranks=lambda a: self.RANKS, window_s=window_s)
        self.api = LocalApi(slots=self.slots, grants=self.grants.forward)
        self.api.reports.register(spec.attempt_id, spec.fencing_token)
        self._sockets = tempfile.TemporaryDirectory(prefix="ub-", dir="/tmp")  # a socket path holds 107 bytes
        self.path = Path(self._sockets.name) / f"{spec.attempt_id}.0.sock"
        self.api.open(spec.attempt_id, self.path, ranks=self.RANKS)

    def checkpoint(self, step: int) -> list[str]:
        """Every rank saves its shard of ``step`` as a worker does: a slot, a grant, the PUT, the
        release, all at once; each rank's slot use."""
        spec = self.spec
        prefix = keys.job_checkpoint_prefix(spec.job_id)
        start = threading.Barrier(self.RANKS)
        never = threading.Event()
        uses: dict[int, str] = {}

        def rank(r: int) -> None:
            ctx = WorkerContext(job_id=spec.job_id, attempt_id=spec.attempt_id, fencing_token=spec.fencing_token,
                                rank=r, world_size=self.RANKS, agent_url=BASE_URL, agent_socket=str(self.path))
            slots = UploadSlots(ctx, unreachable_s=5.0)
            storage = PresignedStorage(AgentGrants(agent_url=BASE_URL, attempt_id=spec.attempt_id,
                                                   fencing_token=spec.fencing_token, rank=r, wait_s=10,
                                                   agent_socket=str(self.path)))
            data = f"rank {r} step {step}".encode()
            start.wait()
            grant = slots.acquire(step, len(data), hurry=never)
            key = keys.shard_key(prefix, step, spec.attempt_number, r)
            assert storage.put_object(key, io.BytesIO(data), length=len(data)).size == len(data)
            assert slots.release(step, ok=True, uploaded_bytes=len(data), upload_s=0.01)
            uses[r] = grant.use

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.RANKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PROMPTLY_S * 2)
        assert sorted(uses) == list(range(self.RANKS)), "not every rank saved its shard"
        return [uses[r] for r in sorted(uses)]

    def close(self) -> None:
        self.slots.close()
        self.api.stop()
        self.client.close()
        self._sockets.cleanup()


@pytest.mark.parametrize("limit", [0, 3])
def test_an_8_rank_nodes_checkpoint_costs_a_few_requests_not_three_per_rank(settings: Settings, s3_bucket: Any,
                                                                            limit: int) -> None:
    """The three sides with their own code (worker_runtime's UploadSlots and presigned storage -> the
    agent's local API, SlotRelay and GrantRelay -> the control plane), counted at the agent's client:
    with batching a checkpoint costs the control plane a few requests for the whole node (without a
    slot limit: one for the asks, one for the grants, one for the releases); relayed one by one, as
    before, three per rank (24)."""
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "upload_slots_max": limit})
    app = create_app(s3)
    with serve(app) as url:
        node = Node(url, app, window_s=WAVE_S)
        try:
            node.client.sent.clear()
            assert node.checkpoint(10) == ["granted"] * Node.RANKS
            batched = dict(node.client.sent)
            print(f"slot limit {limit or 'none'}: batched {batched}")
            assert set(batched) <= {"upload-slots/batch", "storage/batch"}, batched
            if limit == 0:  # the ranks' asks, grants and releases each went as one request, or nearly
                assert sum(batched.values()) <= 6, batched
            assert node.slots.asks.items + node.slots.releases.items >= 2 * Node.RANKS

            node.slots.batching = node.grants.batching = False  # an agent relaying one by one, as before
            node.client.sent.clear()
            assert node.checkpoint(20) == ["granted"] * Node.RANKS
            single = dict(node.client.sent)
            print(f"slot limit {limit or 'none'}: one by one {single}")
            assert single["storage"] == single["upload-slots/release"] == Node.RANKS
            assert single["upload-slots"] >= Node.RANKS and sum(single.values()) >= 3 * Node.RANKS
            # Under a limit the waves of grants (8 ranks, 3 at a time) cost requests each, batched or
            # not; batched, a wave's ranks still share them.
            assert sum(batched.values()) < sum(single.values())
            assert node.stale == []
        finally:
            node.close()


class WithoutBatchPaths:
    """The control plane as it was before the batch paths: they are not found (404), the rest is served."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/batch"):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"detail": "Not Found"}'})
            return
        await self.app(scope, receive, send)


def test_an_agent_falls_back_to_the_single_paths_of_an_older_control_plane(settings: Settings,
                                                                          s3_bucket: Any) -> None:
    """A control plane without the batch paths answers them 404: the agent's relays then send each
    request on its own, the first batch's items included, and remember it."""
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "upload_slots_max": 2})
    app = create_app(s3)
    with serve(WithoutBatchPaths(app)) as url:  # type: ignore[arg-type]
        node = Node(url, app)
        try:
            node.client.sent.clear()
            assert node.checkpoint(10) == ["granted"] * Node.RANKS
            assert not node.slots.batching and not node.grants.batching
            sent = dict(node.client.sent)
            # The batches sent before the first 404 came back (a few ranks' requests apart), then each
            # request on its own, the refused batches' included.
            assert sent["storage/batch"] >= 1 and sent["storage"] == Node.RANKS, sent
            assert sent["upload-slots/batch"] >= 1 and sent["upload-slots/release"] == Node.RANKS, sent
            assert sent["upload-slots"] >= Node.RANKS, sent
            node.client.sent.clear()
            assert node.checkpoint(20) == ["granted"] * Node.RANKS
            assert not [path for path in node.client.sent if path.endswith("/batch")]
        finally:
            node.close()


def test_releases_a_busy_control_plane_refuses_are_held_by_the_agent_and_resent(settings: Settings) -> None:
    """The bookkeeping gate full (one report in flight; a report waits 0.5 s at most): the node's 8
    releases are answered 503. The agent answers each worker at once (``held``), keeps the releases and resends
    them after the Retry-After, together, once the gate has room: every slot ends released with
    what its worker said, none left to expire."""
    gated = settings.model_copy(update={"bookkeeping_gate": True, "bookkeeping_concurrency": 1,
                                        "bookkeeping_wait_s": 0.5, "upload_slots_max": Node.RANKS})
    app = create_app(gated)
    with serve(app) as url:
        node = Node(url, app)
        spec = node.spec
        try:
            contexts = [WorkerContext(job_id=spec.job_id, attempt_id=spec.attempt_id, fencing_token=spec.fencing_token,
                                      rank=r, world_size=Node.RANKS, agent_url=BASE_URL, agent_socket=str(node.path))
                        for r in range(Node.RANKS)]
            slots = [UploadSlots(ctx, unreachable_s=5.0) for ctx in contexts]
            never = threading.Event()
            with ThreadPoolExecutor(Node.RANKS) as pool:
                grants = list(pool.map(lambda s: s.acquire(10, 1000, hurry=never), slots))
            uses = [g.use for g in grants]
            assert uses == ["granted"] * Node.RANKS

            failpoints.configure("agent.events=sleep(3)")  # one report holds the gate's only place
            event = {"rank": 0, "kind": "checkpoint.restored", "message": "restored", "data": {"step": 1}}
            busy = threading.Thread(target=node.client.report_events, args=(spec.attempt_id, WorkerEventBatch(
                fencing_token=spec.fencing_token, node_rank=spec.node_rank, events=[event])))
            busy.start()
            deadline = time.monotonic() + PROMPTLY_S
            while app.state.lanes.figures().bookkeeping_in_flight < 1:
                assert time.monotonic() < deadline, "the held report never reached the gate"
                time.sleep(0.02)
            began = time.monotonic()
            with ThreadPoolExecutor(Node.RANKS) as pool:
                taken = list(pool.map(lambda s: s.release(10, ok=True, uploaded_bytes=1000, upload_s=0.5), slots))
            answered_s = time.monotonic() - began
            assert taken == [True] * Node.RANKS
            assert node.slots.held() == Node.RANKS  # refused (503), held by the agent
            assert {s["state"] for s in _slots(httpx.Client(base_url=url), spec.job_id)["slots"]} == {"granted"}
            assert answered_s < 2.5, answered_s  # the workers were not kept waiting for the gate (3 s)

            sent_before = dict(node.client.sent)
            failpoints.configure("")
            busy.join(PROMPTLY_S)
            deadline = time.monotonic() + PROMPTLY_S
            while node.slots.held():  # the relay's resend thread sends them
                assert time.monotonic() < deadline, "the held releases were never taken"
                time.sleep(0.05)
            resends = node.client.sent["upload-slots/batch"] - sent_before.get("upload-slots/batch", 0)
            # Together: batches only, never one release at a time; one round, another if the first
            # met the gate still held, a third if a round failed in transport (a fresh-clone run saw
            # a resend end in ReadError EBADF once; the releases were kept and sent again).
            assert 1 <= resends <= 3, resends
            assert node.client.sent["upload-slots/release"] == sent_before.get("upload-slots/release", 0)
            with httpx.Client(base_url=url) as http:
                history = _slots(http, spec.job_id)["slots"]
            assert sorted((s["rank"], s["state"], s["ok"], s["uploaded_bytes"]) for s in history) == [
                (r, "released", True, 1000) for r in range(Node.RANKS)]
            # Every held release was resent; one refused again (the gate still held) is resent in the
            # next round and counted again (a fresh-clone run saw 9 for 8 ranks in two rounds).
            assert Node.RANKS <= node.slots.resent <= Node.RANKS * resends, (node.slots.resent, resends)
        finally:
            failpoints.configure("")
            node.close()
