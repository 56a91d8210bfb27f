"""Checkpoint upload slots on real PostgreSQL (services/checkpoints/upload_slots.py, docs/architecture.md
"Checkpoint upload slots"): the cluster-wide and per-domain limits hold while the ranks of a job ask
at once through two control-plane replicas; a release wakes the oldest waiter that fits, held in a
long poll by the other replica; a stale attempt gets 409 and no slot, and the slots of an attempt
that ended are reclaimed; a holder that stops renewing loses its slot when its lease runs out; bad
requests are refused without a 500; each shard's wait shows in the checkpoint view."""

from __future__ import annotations

import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.models import UPLOAD_SLOTS_OPEN_SQL
from control_plane.services.checkpoints.upload_policy import Slot, SlotLimits, grantable
from control_plane.services.states import UPLOAD_SLOT_OPEN
from control_plane.settings import Settings
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, JOIN_TOKEN, job_body, workers_for

PROMPTLY_S = 15.0


def _register(c: httpx.Client | TestClient, name: str, rack: str, gpus: int) -> dict[str, str]:
    r = c.post("/v1/agent/register", headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, json={
        "name": name, "address": "127.0.0.1", "labels": {"rack": rack},
        "gpus": [{"index": i, "uuid": f"{name}-{i}", "kind": "virtual-cpu", "memory_mb": 0} for i in range(gpus)],
    })
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['node_token']}"}


class Job:
    """A job of len(racks) nodes x ``gpus`` ranks placed by a real scheduling pass; each node's
    credential and launch spec, as its agent would hold them."""

    def __init__(self, c: httpx.Client | TestClient, app: Any, racks: list[str], gpus: int) -> None:
        self.auth = [_register(c, f"node-{i}", rack, gpus) for i, rack in enumerate(racks)]
        body = job_body(num_nodes=len(racks), gpus_per_node=gpus, max_failures=3)
        r = c.post("/v1/jobs", json=body, headers=ADMIN)
        assert r.status_code == 201, r.text
        self.id = r.json()["id"]
        assert app.state.loops.schedule_once() == 1
        self.specs = []
        for auth in self.auth:
            r = c.post("/v1/agent/heartbeat", headers=auth, json={"agent_instance": "i", "seq": 1, "attempts": []})
            self.specs.append(r.json()["assignments"][0])
        self.racks = {s["node_rank"]: racks[i] for i, s in enumerate(self.specs)}
        self.gpus = gpus

    def node_of(self, rank: int) -> int:
        return min(rank // self.gpus, len(self.specs) - 1)

    def ask(self, c: httpx.Client | TestClient, rank: int, *, step: int = 10, wait_s: float = 0.0,
            token: str | None = None, node: int | None = None) -> httpx.Response:
        n = self.node_of(rank) if node is None else node
        spec = self.specs[n]
        return c.post(f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots", headers=self.auth[n],
                      json={"fencing_token": token or spec["fencing_token"], "node_rank": spec["node_rank"],
                            "rank": rank, "step": step, "size_bytes": 1000, "wait_s": wait_s})

    def release(self, c: httpx.Client | TestClient, rank: int, *, step: int = 10) -> httpx.Response:
        n = self.node_of(rank)
        spec = self.specs[n]
        return c.post(f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots/release", headers=self.auth[n],
                      json={"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"], "rank": rank,
                            "step": step, "uploaded_bytes": 1000, "upload_s": 0.5})


def _slots(c: httpx.Client | TestClient, job_id: str | None = None) -> dict[str, Any]:
    r = c.get("/v1/upload-slots", headers=ADMIN, params={"job_id": job_id} if job_id else {})
    assert r.status_code == 200, r.text
    return r.json()


def _waiting_positions(c: httpx.Client, job: Job) -> list[dict[str, Any]]:
    """Each waiting rank's answer to a poll that does not wait (its queue position)."""
    ranks = [s["rank"] for s in _slots(c, job.id)["slots"] if s["state"] == "waiting"]
    return [job.ask(c, r).json() for r in ranks]


def _check_limits(view: dict[str, Any], cluster: int, per_label: int) -> None:
    granted = [s for s in view["slots"] if s["state"] == "granted"]
    assert len(granted) <= cluster, granted
    per = {}
    for s in granted:
        per[s["label"]] = per.get(s["label"], 0) + 1
    assert all(n <= per_label for n in per.values()), per


def test_limits_hold_across_two_replicas_and_a_release_wakes_the_oldest_waiter(settings: Settings) -> None:
    limited = settings.model_copy(update={"upload_slots_max": 3, "upload_slots_per_label": 2})
    a, b = create_app(limited), create_app(limited)  # two replicas, one database
    with serve(a) as url_a, serve(b) as url_b, httpx.Client(base_url=url_a, timeout=60) as ca, \
            httpx.Client(base_url=url_b, timeout=60) as cb:
        job = Job(ca, a, ["r1", "r1", "r2", "r2"], gpus=4)  # 16 ranks, two racks
        with ThreadPoolExecutor(16) as pool:  # every rank at once, half through each replica
            answers = list(pool.map(lambda r: job.ask(ca if r % 2 else cb, r).json(), range(16)))
        assert all(x["state"] in ("granted", "waiting") for x in answers)
        # A request that found another's pass running is answered "waiting" at once (it asked not to
        # wait); its replica's runner runs the next pass for it: exactly the limits end up granted.
        deadline = time.monotonic() + PROMPTLY_S
        while (view := _slots(cb))["granted"] < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (view["granted"], view["waiting"]) == (3, 13)
        _check_limits(view, 3, 2)
        state = {s["rank"]: s["state"] for s in view["slots"]}
        assert {r for r, x in enumerate(answers) if x["state"] == "granted"} <= {r for r in state
                                                                               if state[r] == "granted"}

        # Every waiter holds a long poll, on either replica.
        waiting = sorted(r for r in state if state[r] == "waiting")
        polls: dict[int, Any] = {}

        def poll(rank: int) -> None:
            polls[rank] = job.ask(ca if rank % 2 else cb, rank, wait_s=45).json()

        threads = [threading.Thread(target=poll, args=(r,), daemon=True) for r in waiting]
        for t in threads:
            t.start()
        deadline = time.monotonic() + PROMPTLY_S
        while a.state.slot_wakeups.waiting + b.state.slot_wakeups.waiting < len(waiting):
            assert time.monotonic() < deadline, "the long polls were not all registered"
            time.sleep(0.02)
        assert sorted(s["position"] for s in _waiting_positions(ca, job)) == list(range(13))

        # Hand the slots back one by one: each release wakes exactly the waiter the policy names.
        holders = sorted(r for r in state if state[r] == "granted")
        woken_in_order: list[int] = []
        while holders:
            view = _slots(ca, job.id)
            open_ = [s for s in view["slots"] if s["state"] in ("waiting", "granted")]
            rank = holders.pop(0)
            after = [Slot(s["id"], s["seq"], s["label"], s["node_id"]) for s in open_
                     if s["state"] == "granted" and s["rank"] != rank]
            queue = [Slot(s["id"], s["seq"], s["label"], s["node_id"]) for s in open_ if s["state"] == "waiting"]
            expected = grantable(SlotLimits(cluster=3, per_label=2), after, queue)
            answered_before = set(polls)
            assert job.release(cb if rank % 2 else ca, rank).json() == {"released": True}
            by_id = {s["id"]: s["rank"] for s in open_}
            woken = {by_id[i] for i in expected}
            deadline = time.monotonic() + PROMPTLY_S
            while not woken <= set(polls):
                assert time.monotonic() < deadline, f"waiters {woken - set(polls)} not woken by the release"
                time.sleep(0.02)
            assert set(polls) - answered_before == woken
            assert all(polls[w]["state"] == "granted" and polls[w]["position"] == 0 for w in woken)
            _check_limits(_slots(ca), 3, 2)
            holders += sorted(woken)
            woken_in_order += sorted(woken)
        assert sorted(polls) == waiting
        history = _slots(ca, job.id)["slots"]
        assert len(history) == 16 and {s["state"] for s in history} == {"released"}
        by_rank_label = {s["rank"]: s["label"] for s in history}
        # First come, first served within each domain, among the waiters the releases woke. Not
        # checked on the opening burst nor by granted_at: a seq is drawn at insert, before its
        # commit, so a pass may grant a later seq whose insert committed first; and each replica's
        # clock is the database's to within a round trip, so two replicas' granted_at may invert.
        seq_of = {s["rank"]: s["seq"] for s in history}
        for rack in ("r1", "r2"):
            seqs = [seq_of[r] for r in woken_in_order if by_rank_label[r] == rack]
            assert seqs == sorted(seqs)
        for t in threads:
            t.join(PROMPTLY_S)


def test_stale_attempts_get_no_slot_and_an_ended_attempts_slots_are_reclaimed(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"upload_slots_max": 1}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=2)
        assert job.ask(c, 0, wait_s=PROMPTLY_S).json()["state"] == "granted"
        assert job.ask(c, 1).json()["state"] == "waiting"
        wrong = job.ask(c, 1, token="not-the-token")
        assert wrong.status_code == 409 and wrong.json()["type"].endswith("/stale-attempt")
        spec = job.specs[0]
        r = c.post(f"/v1/agent/attempts/{spec['attempt_id']}/status", headers=job.auth[0], json={
            "fencing_token": spec["fencing_token"], "node_rank": 0, "state": "exited", "exit_code": 1,
            "workers": workers_for(spec, "exited", 1)})
        assert r.status_code == 200, r.text
        refused = job.ask(c, 1)
        assert refused.status_code == 409 and refused.headers["content-type"].startswith("application/problem+json")
        assert _slots(c)["granted"] == 1  # until a grant pass runs: the maintenance loop's, here
        app.state.loops.checkpoints_once()
        view = _slots(c, job.id)
        assert view["granted"] == view["waiting"] == 0
        assert {s["state"] for s in view["slots"]} == {"expired"}
        kinds = [e["kind"] for e in c.get(f"/v1/jobs/{job.id}/events", headers=ADMIN,
                                          params={"limit": 1000}).json()["items"]]
        assert "upload_slot.expired" in kinds


def test_a_holder_that_stops_renewing_loses_its_slot_to_the_next_waiter(settings: Settings, clock) -> None:
    app = create_app(settings.model_copy(update={"upload_slots_max": 1, "upload_slot_ttl_s": 30}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=2)
        first = job.ask(c, 0, wait_s=PROMPTLY_S).json()
        assert first["state"] == "granted" and first["ttl_s"] == pytest.approx(30)
        clock.advance(20)
        assert job.ask(c, 0).json()["ttl_s"] == pytest.approx(30)  # a renewal extends the lease
        assert job.ask(c, 1).json()["state"] == "waiting"
        clock.advance(20)
        assert job.ask(c, 1).json()["state"] == "waiting"  # rank 0's lease still runs (10 s left)
        clock.advance(11)  # rank 0 crashed: no renewal, its lease is over
        # A long poll: an ask that finds the replica's runner mid-pass answers "waiting" at once and
        # leaves the grant to the next pass (CI under load saw it), which then wakes this poll.
        assert job.ask(c, 1, wait_s=PROMPTLY_S).json()["state"] == "granted"
        by_rank = {s["rank"]: s for s in _slots(c, job.id)["slots"]}
        assert by_rank[0]["state"] == "expired" and by_rank[1]["state"] == "granted"
        events = c.get(f"/v1/jobs/{job.id}/events", headers=ADMIN, params={"limit": 1000}).json()["items"]
        assert [e["data"]["ranks"] for e in events if e["kind"] == "upload_slot.expired"] == [[0]]
        # The crashed rank, back, queues like anyone (its old slot is not revived).
        assert job.ask(c, 0).json()["state"] == "waiting"


def test_a_waiting_rank_keeps_its_place_while_it_asks_however_long_the_answer_takes(settings: Settings,
                                                                                     clock) -> None:
    """Under load (bench/upload.py, 1,024 ranks) queue places expired while their ranks were still in
    a long poll that the control plane was slow to answer: the rank asked again anew, at the back of
    the queue. Here the answer takes longer than the place's lease (the clock jumps while the poll is
    held); the place must outlive it, and expire a lease after its rank stops asking."""
    app = create_app(settings.model_copy(update={"upload_slots_max": 1, "upload_slot_ttl_s": 30}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=3)
        assert job.ask(c, 0, wait_s=PROMPTLY_S).json()["state"] == "granted"
        answer: dict[str, Any] = {}
        poll = threading.Thread(target=lambda: answer.update(job.ask(c, 1, wait_s=5).json()), daemon=True)
        poll.start()
        deadline = time.monotonic() + PROMPTLY_S
        while not [s for s in _slots(c, job.id)["slots"] if s["rank"] == 1]:
            assert time.monotonic() < deadline, "rank 1 never queued"
            time.sleep(0.02)
        [queued] = [s for s in _slots(c, job.id)["slots"] if s["rank"] == 1]
        clock.advance(120)  # far past the place's lease (5 s of poll + 30 s), the poll still held
        assert job.ask(c, 0).json()["state"] == "granted"  # the holder renews: it is alive too
        assert job.ask(c, 2).json()["position"] == 1  # a later rank queues behind rank 1 (and runs a pass)
        assert job.release(c, 0).json() == {"released": True}
        poll.join(PROMPTLY_S)
        assert answer.get("state") == "granted" and answer.get("slot_id") == queued["id"], answer  # its place, kept
        by_rank = {s["rank"]: s for s in _slots(c, job.id)["slots"] if s["state"] != "released"}
        assert by_rank[1]["state"] == "granted" and by_rank[2]["state"] == "waiting"
        # Rank 2 asked once and stopped (crashed): its place lasts a lease, no more.
        clock.advance(31)
        assert job.release(c, 1).json() == {"released": True}  # a pass: rank 2 is reclaimed, not granted
        deadline = time.monotonic() + PROMPTLY_S
        while {s["rank"]: s["state"] for s in _slots(c, job.id)["slots"]}[2] != "expired":
            assert time.monotonic() < deadline, "rank 2's place never expired"
            time.sleep(0.02)
        events = c.get(f"/v1/jobs/{job.id}/events", headers=ADMIN, params={"limit": 1000}).json()["items"]
        assert [e["data"]["ranks"] for e in events if e["kind"] == "upload_slot.expired"] == [[2]]


def test_bad_slot_requests_are_refused_without_a_500(settings: Settings) -> None:
    app = create_app(settings)
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=2)
        assert job.ask(c, 2).status_code == 422  # outside the world
        r = job.ask(c, 0, wait_s=61)
        assert r.status_code == 422 and "wait_s" in r.text
        spec = job.specs[0]
        url = f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots"
        assert c.post(url, json={"fencing_token": "x", "node_rank": 0, "rank": 0, "step": 1,
                                 "size_bytes": 1}).status_code == 401
        other = c.post("/v1/agent/attempts/00000000-0000-0000-0000-000000000000/upload-slots", headers=job.auth[0],
                       json={"fencing_token": "x", "node_rank": 0, "rank": 0, "step": 1, "size_bytes": 1})
        assert other.status_code == 409
        assert c.post(url, headers=job.auth[0], json={"rank": -1}).status_code == 422
        unlimited = job.ask(c, 0).json()  # no limit configured: granted as asked, unpaced
        assert unlimited["state"] == "granted" and unlimited["rate_bytes_per_s"] is None
        assert job.release(c, 1).json() == {"released": False}  # never asked for
        assert c.get("/v1/upload-slots", headers=ADMIN,
                     params={"job_id": "00000000-0000-0000-0000-000000000000"}).status_code == 404
        assert c.get("/v1/upload-slots").status_code == 401


def test_many_slot_requests_on_one_database_connection_are_never_a_500(settings: Settings) -> None:
    """bench/upload.py's 1,024 ranks got 500s: psycopg prepares a statement on a connection after its
    fifth run, and a prepared INSERT ... ON CONFLICT whose index predicate was a bound parameter no
    longer matched the partial unique index ("no unique or exclusion constraint matching the ON
    CONFLICT specification"). Sequential requests share the pool's few connections, so each runs the
    statement far more than five times."""
    app = create_app(settings.model_copy(update={"upload_slots_max": 2}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1", "r2"], gpus=8)
        for step in (1, 2):  # a renewal or a poll of an existing slot runs the insert too (it does nothing)
            answers = [job.ask(c, rank, step=step) for rank in range(16) for _ in range(2)]
            assert [r.status_code for r in answers] == [200] * 32, [r.text for r in answers if r.status_code != 200]
        view = _slots(c, job.id)
        assert len(view["slots"]) == 32 and view["granted"] == 2
    # The index predicate names exactly the open states.
    expected = f"state IN ({', '.join(repr(s) for s in UPLOAD_SLOT_OPEN)})"
    assert expected == UPLOAD_SLOTS_OPEN_SQL


def test_a_nodes_budget_is_shared_by_its_holders(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"upload_node_rate_bytes_per_s": 1_000_000}))
    with TestClient(app) as c:
        job = Job(c, app, ["r1", "r2"], gpus=2)
        spec = job.specs[1]
        r = c.post(f"/v1/agent/attempts/{spec['attempt_id']}/status", headers=job.auth[1], json={
            "fencing_token": spec["fencing_token"], "node_rank": 1, "state": "running",
            "workers": workers_for(spec, "running")})
        assert r.status_code == 200, r.text
        forged = job.ask(c, 2, node=0)  # a node asks only for its own ranks (2 runs on node rank 1)
        assert forged.status_code == 403, forged.text
        assert job.ask(c, 0).json()["rate_bytes_per_s"] == 1_000_000
        assert job.ask(c, 1).json()["rate_bytes_per_s"] == 500_000  # the node's second upload
        assert job.ask(c, 2).json()["rate_bytes_per_s"] == 1_000_000  # another node's budget
        assert job.ask(c, 0).json()["rate_bytes_per_s"] == 500_000  # a renewal brings the current share
        job.release(c, 1)
        assert job.ask(c, 0).json()["rate_bytes_per_s"] == 1_000_000


def test_the_checkpoint_view_shows_each_shards_wait_and_rate(settings: Settings) -> None:
    app = create_app(settings)
    with TestClient(app) as c:
        job = Job(c, app, ["r1"], gpus=2)
        spec = job.specs[0]
        prefix = f"jobs/{job.id}/checkpoints/step-000000010/attempt-0001"
        shards = [{"rank": r, "step": 10, "world_size": 2, "key": f"{prefix}/rank-{r:05d}.pt", "size_bytes": 4000,
                   "sha256": "a" * 64, "upload": {"wait_s": w, "upload_s": 2.0, "slot": slot}}
                  for r, w, slot in ((0, 1.5, "granted"), (1, 3.5, "bypassed"))]
        r = c.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=job.auth[0],
                   json={"fencing_token": spec["fencing_token"], "node_rank": 0, "shards": shards})
        assert r.status_code == 200, r.text
        [ckpt] = c.get(f"/v1/jobs/{job.id}/checkpoints", headers=ADMIN).json()["items"]
        assert ckpt["upload"] == {"reported": 2, "wait_s_max": 3.5, "wait_s_mean": 2.5, "upload_s_max": 2.0,
                                  "bytes_per_s": 2000.0, "bypassed": 1}


def test_a_worker_waits_for_its_slot_through_its_agent(settings: Settings) -> None:
    """The three sides with their own code (worker_runtime's UploadSlots -> the agent's local API and
    SlotRelay -> the control plane): a worker waits in a long poll until another's release, a worker
    with a wrong token is refused by its agent, and a stale attempt's worker gets no slot while its
    agent is told to stop it."""
    from node_agent.link.client import ControlPlaneClient, RetryPolicy
    from node_agent.link.upload_slots import SlotRelay
    from node_agent.local.api import BASE_URL, LocalApi
    from trainyard.protocol.agent import AttemptStatusReport, HeartbeatRequest, RegisterRequest
    from worker_runtime import WorkerContext
    from worker_runtime.checkpoint.slots import UploadSlots

    app = create_app(settings.model_copy(update={"upload_slots_max": 1}))
    with serve(app) as url:
        client = ControlPlaneClient(url, join_token=JOIN_TOKEN, retry=RetryPolicy(attempts=1))
        client.register(RegisterRequest.model_validate({"name": "node-0", "address": "127.0.0.1", "gpus": [
            {"index": i, "uuid": f"node-0-{i}", "kind": "virtual-cpu", "memory_mb": 0} for i in range(2)]}))
        with httpx.Client(base_url=url) as admin:
            assert admin.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=2),
                              headers=ADMIN).status_code == 201
        assert app.state.loops.schedule_once() == 1
        [spec] = client.heartbeat(HeartbeatRequest(agent_instance="i", seq=1)).assignments
        stale: list[str] = []
        relay = SlotRelay(client, target=lambda a: (spec.fencing_token, spec.node_rank),
                          on_stale=lambda a, exc: stale.append(a), on_unauthorized=lambda: None)
        api = LocalApi(slots=relay)
        api.reports.register(spec.attempt_id, spec.fencing_token)
        sockets = tempfile.TemporaryDirectory(prefix="us-", dir="/tmp")  # a socket path holds 107 bytes
        path = Path(sockets.name) / f"{spec.attempt_id}.0.sock"
        api.open(spec.attempt_id, path)
        try:
            def worker(rank: int, token: str = spec.fencing_token) -> UploadSlots:
                ctx = WorkerContext(job_id=spec.job_id, attempt_id=spec.attempt_id, fencing_token=token, rank=rank,
                                    world_size=2, agent_url=BASE_URL, agent_socket=str(path))
                return UploadSlots(ctx, unreachable_s=5.0)

            never = threading.Event()
            first = worker(0).acquire(10, 1000, hurry=never)
            assert first.use == "granted" and first.slot_id
            second: list[Any] = []
            waiter = threading.Thread(target=lambda: second.append(worker(1).acquire(10, 1000, hurry=never)))
            waiter.start()
            deadline = time.monotonic() + PROMPTLY_S
            while app.state.slot_wakeups.waiting < 1:
                assert time.monotonic() < deadline, "the second worker is not waiting in a long poll"
                time.sleep(0.02)
            assert second == []
            assert worker(0).release(10, ok=True, uploaded_bytes=1000, upload_s=0.1)
            waiter.join(PROMPTLY_S)
            assert second and second[0].use == "granted" and second[0].slot_id != first.slot_id
            assert worker(1, token="forged").acquire(11, 1, hurry=never).stale  # refused by the agent itself
            assert stale == []

            client.report_status(spec.attempt_id, AttemptStatusReport(
                fencing_token=spec.fencing_token, node_rank=0, state="exited", exit_code=1))
            late = worker(0).acquire(12, 1000, hurry=never)
            assert late.stale and late.use == "none"
            assert stale == [spec.attempt_id]  # the agent learns the attempt is stale and stops it
        finally:
            api.stop()
            client.close()
            sockets.cleanup()


@pytest.fixture
def storage_client(settings: Settings, s3_bucket: Any) -> Any:
    """A control plane that signs storage URLs on the real S3 server, with 5 MiB parts."""
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "storage_part_size_mb": 5,
    })
    with TestClient(create_app(s3)) as c:
        yield c


def test_a_workers_presigned_upload_keeps_to_its_slots_rate_in_one_put_and_in_parts(storage_client: Any) -> None:
    """A worker under an agent uploads through presigned URLs (presigned.py): a granted rate paces
    that upload too, whether it goes in one PUT or in parts, and what is stored is the whole shard."""
    import hashlib
    import io

    from control_plane.app import object_store
    from tests.control_plane.test_storage_grants import Job as GrantedJob
    from trainyard.storage.pacing import CHUNK, Pacer

    job = GrantedJob(storage_client, "paced", nodes=1, gpus=1)
    store = object_store(storage_client.app.state.settings)
    storage, grants = job.storage(0)
    burst = 4 * CHUNK
    for step, size, rate in ((10, 1_500_000, 1_000_000), (20, 11 * 2**20 + 5, 24 * 2**20)):
        data = (bytes(range(256)) * (size // 256 + 1))[:size]
        key = job.shard_key(step, 0)
        pacer = Pacer(rate)
        started = time.monotonic()
        assert storage.put_object_paced(key, io.BytesIO(data), length=size, pace=pacer).size == size
        took = time.monotonic() - started
        assert took >= (size - burst) / rate, f"{size} bytes went up in {took:.2f}s, faster than {rate} B/s"
        assert pacer.waited_s > 0
        assert hashlib.sha256(store.get_bytes(key)).digest() == hashlib.sha256(data).digest()
    assert [m for m, _ in grants.asked] == ["PUT", "PUT", "PUT"]  # one PUT; then the create and the parts
