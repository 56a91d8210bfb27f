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

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest
import urllib3
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.settings import Settings
from tests.control_plane.test_storage_grants import Job as GrantedJob
from tests.control_plane.test_upload_slots import PROMPTLY_S, Job, _slots
from tests.factories import workers_for

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
