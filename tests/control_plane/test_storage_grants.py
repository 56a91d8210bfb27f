"""Scoped checkpoint storage (issue 11, finding 3), on a real control plane, PostgreSQL and SeaweedFS.

Workers hold no storage credential (before, every worker held the S3 root keys); all they can do
is what the control plane's presigned URLs allow. A hostile worker of job B tries, with the URLs
and whatever else it can ask for, to list, read, overwrite or delete job A's objects, and a worker
of A to change A's committed checkpoint: every try fails, at the control plane (no URL is signed)
or at S3 (the signature does not cover the request). Saving and restoring through the same URLs
works (the e2e recovery tests run tiny-gpt on them).
"""

from __future__ import annotations

import hashlib
import io
import json
from datetime import timedelta
from typing import Any

import pytest
import urllib3
from fastapi.testclient import TestClient

from control_plane.app import create_app, object_store
from control_plane.clock import wall
from control_plane.settings import Settings
from tests.factories import ADMIN, FakeAgentSession, job_body, workers_for
from trainyard.protocol import keys
from trainyard.protocol.grants import StorageGrants
from trainyard.protocol.storage import ObjectNotFoundError
from worker_runtime.checkpoint.presigned import GrantRefused, PresignedStorage

HTTP = urllib3.PoolManager(retries=False)


@pytest.fixture
def client(settings: Settings, s3_bucket) -> Any:
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "storage_part_size_mb": 5,
    })
    with TestClient(create_app(s3)) as c:
        yield c


class Grants:
    """A worker's grant source, through its node's credential (what its agent forwards), counting
    the requests it makes."""

    def __init__(self, client: TestClient, agent: FakeAgentSession, spec: dict, rank: int,
                 token: str | None = None) -> None:
        self.client, self.agent, self.spec, self.rank = client, agent, spec, rank
        self.token = token or spec["fencing_token"]
        self.asked: list[tuple[str, str]] = []

    def ask(self, method: str, key: str, **extra: Any) -> Any:
        self.asked.append((method, key))
        body = {"fencing_token": self.token, "node_rank": self.spec["node_rank"], "rank": self.rank,
                "method": method, "key": key, **extra}
        return self.client.post(f"/v1/agent/attempts/{self.spec['attempt_id']}/storage", json=body,
                                headers=self.agent.headers)

    def grants(self, method: str, key: str, *, size_bytes: int | None = None,
               upload_id: str | None = None) -> StorageGrants:
        r = self.ask(method, key, size_bytes=size_bytes, upload_id=upload_id)
        if r.status_code == 404:
            raise ObjectNotFoundError(key)
        if r.status_code != 200:
            raise GrantRefused(r.status_code, r.json()["detail"])
        return StorageGrants.model_validate(r.json())


class Job:
    """A job on its own fake agents (one per node), which speak the real wire protocol."""

    def __init__(self, client: TestClient, name: str, nodes: int, gpus: int) -> None:
        self.client = client
        self.agents = [FakeAgentSession(client, f"{name}-{i}", gpus) for i in range(nodes)]
        self.job = client.post("/v1/jobs", json=job_body(name=name, num_nodes=nodes, gpus_per_node=gpus,
                                                         max_failures=3), headers=ADMIN).json()
        assert client.app.state.loops.schedule_once() == 1
        self.specs = [a.heartbeat()["assignments"][0] for a in self.agents]
        self.prefix = keys.job_checkpoint_prefix(self.job["id"])

    def node_of(self, rank: int) -> tuple[FakeAgentSession, dict]:
        gpus = self.specs[0]["nproc_per_node"]
        return next((a, s) for a, s in zip(self.agents, self.specs, strict=True) if s["node_rank"] == rank // gpus)

    def grants(self, rank: int) -> Grants:
        return Grants(self.client, *self.node_of(rank), rank)

    def storage(self, rank: int) -> tuple[PresignedStorage, Grants]:
        grants = self.grants(rank)
        return PresignedStorage(grants), grants

    def shard_key(self, step: int, rank: int) -> str:
        return keys.shard_key(self.prefix, step, self.specs[0]["attempt_number"], rank)

    def save(self, step: int, rank: int, data: bytes, *, upload: bool = True) -> dict:
        """Rank ``rank`` uploads its shard through its grants and its agent reports it."""
        key = self.shard_key(step, rank)
        if upload:
            storage, _ = self.storage(rank)
            assert storage.put_object(key, io.BytesIO(data), length=len(data)).size == len(data)
        agent, spec = self.node_of(rank)
        shard = {"rank": rank, "step": step, "world_size": len(self.specs) * spec["nproc_per_node"], "key": key,
                 "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        r = self.client.post(f"/v1/agent/attempts/{spec['attempt_id']}/shards", headers=agent.headers,
                             json={"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                                   "shards": [shard]})
        assert r.status_code == 200, r.text
        return r.json()

    def fail_and_recover(self) -> dict:
        """The attempt fails (a worker exits 1); the next one starts: its restore plan."""
        agent, spec = self.agents[0], self.specs[0]
        agent.status(spec, "exited", exit_code=1, workers=workers_for(spec, "exited", 1))
        for a in self.agents:
            a.heartbeat([])
        assert self.client.app.state.loops.schedule_once() == 1
        self.specs = [a.heartbeat()["assignments"][0] for a in self.agents]
        return self.specs[0]["restore_from"]


def _send(grant: dict | Any, *, method: str | None = None, url: str | None = None, body: bytes | None = None,
          headers: dict[str, str] | None = None) -> int:
    g = grant if isinstance(grant, dict) else grant.model_dump(mode="json")
    return HTTP.request(method or g["method"], url or g["url"], body=body,
                        headers=g["headers"] if headers is None else headers).status


def test_a_worker_creates_its_own_shards_once_and_touches_nothing_else(client, s3_bucket):
    store = object_store(client.app.state.settings)
    a, b = Job(client, "a", nodes=2, gpus=2), Job(client, "b", nodes=1, gpus=1)
    victim = a.shard_key(10, 0)

    # Rank 0 of A writes its own shard through a create-only URL.
    r = a.grants(0).ask("PUT", victim, size_bytes=8)
    assert r.status_code == 200, r.text
    [put] = r.json()["grants"]
    assert put["key"] == victim and put["headers"] == {"If-None-Match": "*", "Content-Length": "8"}
    assert "X-Amz-Credential" in put["url"] and s3_bucket.secret_key not in put["url"]
    assert _send(put, body=b"genuine!") == 200
    assert store.get_bytes(victim) == b"genuine!"
    # The same URL overwrites nothing: with its signed header S3 refuses (412), without it the
    # signature does not match (403), and as a DELETE it is not signed for the method (403).
    assert _send(put, body=b"forgery!") == 412
    assert _send(put, body=b"forgery!", headers={}) == 403
    assert _send(put, method="DELETE", headers={"If-None-Match": "*"}) == 403  # no body: no Content-Length
    # Nor does a fresh grant: the worker's storage says the object exists.
    with pytest.raises(FileExistsError):
        a.storage(0)[0].put_object(victim, io.BytesIO(b"forgery!"), length=8)
    with pytest.raises(PermissionError):
        a.storage(0)[0].delete(victim)
    # Moving the URL to another object breaks its signature.
    assert _send(put, url=put["url"].replace(a.job["id"], b.job["id"]), body=b"forgery!") == 403

    # Nothing else is signed: another rank's, another attempt's or another job's key, a manifest,
    # a prefix (a listing), a path that climbs out, a key on the wrong method.
    hostile = b.grants(0)
    refused = {
        "another job's shard": hostile.ask("PUT", victim, size_bytes=8),
        "another job's read": hostile.ask("GET", victim),
        "a climb out of its prefix": hostile.ask(
            "PUT", f"{b.prefix}/step-000000010/attempt-0001/../../../../{victim}", size_bytes=8),
        "its prefix, for a listing": hostile.ask("GET", b.prefix + "/"),
        "the bucket": hostile.ask("GET", "/"),
        "another rank's shard": a.grants(0).ask("PUT", a.shard_key(10, 1), size_bytes=8),
        "a manifest": a.grants(0).ask("PUT", keys.manifest_key(a.prefix, 10, a.specs[0]["attempt_number"]),
                                      size_bytes=8),
        "another attempt's shard": a.grants(0).ask("PUT", keys.shard_key(a.prefix, 10, 7, 0), size_bytes=8),
        "a rank outside the world": Grants(client, *a.node_of(0), rank=4).ask("PUT", a.shard_key(10, 4),
                                                                              size_bytes=8),
    }
    assert {why: r.status_code for why, r in refused.items()} == {why: 403 for why in refused}
    # A forged fencing token, or a node that does not hold the claimed node rank.
    assert Grants(client, *a.node_of(0), 0, token="forged").ask("PUT", victim, size_bytes=8).status_code == 409
    assert Grants(client, *a.node_of(0), 0, token="forgé").ask("PUT", victim, size_bytes=8).status_code == 422
    wrong_node = Grants(client, a.agents[1], a.specs[0], 0).ask("PUT", a.shard_key(20, 0), size_bytes=8)
    assert wrong_node.status_code == 403

    # Once committed, no grant for the step, and the old URL still creates nothing.
    a.save(10, 1, b"rank one")
    for rank in (2, 3):
        a.save(10, rank, f"rank {rank}".encode())
    ack = a.save(10, 0, b"genuine!", upload=False)  # uploaded above: only its report was missing
    assert ack["committed_steps"] == [10]
    assert a.grants(0).ask("PUT", victim, size_bytes=8).status_code == 409
    assert _send(put, body=b"forgery!") == 412
    assert store.get_bytes(victim) == b"genuine!"

    # S3 enforces expiry: a URL signed long enough ago is refused.
    stale = store.presign("GET", victim, expires_s=60, now=wall() - timedelta(minutes=5))
    assert HTTP.request("GET", stale).status == 403


def test_a_restoring_worker_reads_only_its_restore_plan(client):
    a, b = Job(client, "a", nodes=2, gpus=2), Job(client, "b", nodes=1, gpus=1)
    shards = {rank: f"state of rank {rank}".encode() for rank in range(4)}
    for rank, data in shards.items():
        a.save(10, rank, data)
    pending = a.shard_key(20, 2)
    a.storage(2)[0].put_object(pending, io.BytesIO(b"uncommitted"), length=11)
    plan = a.fail_and_recover()
    [candidate] = plan["candidates"]

    # Rank 2 of the new attempt reads the manifest, and with it gets its own shard and rank 0's:
    # one grant request for the whole restore.
    storage, asked = a.storage(2)
    manifest = json.loads(storage.get_object(candidate["manifest_key"]).read())
    assert manifest["checkpoint_id"] == candidate["checkpoint_id"]
    for rank in (2, 0):
        key = next(s["key"] for s in manifest["shards"] if s["rank"] == rank)
        assert storage.get_object(key).read() == shards[rank]
        info = storage.stat(key)
        assert info is not None and info.size == len(shards[rank])
    assert asked.asked == [("GET", candidate["manifest_key"])]
    # Not another rank's shard, nor what the plan does not name (an uncommitted step's shard).
    other = next(s["key"] for s in manifest["shards"] if s["rank"] == 3)
    assert a.grants(2).ask("GET", other).status_code == 403
    assert a.grants(2).ask("GET", pending).status_code == 404
    with pytest.raises(ObjectNotFoundError):
        storage.get_object(pending)
    # The new attempt writes nothing of the old one's, nor does job B read any of it.
    assert a.grants(2).ask("PUT", other, size_bytes=1).status_code == 403
    for key in (candidate["manifest_key"], other):
        assert b.grants(0).ask("GET", key).status_code == 403
    # A read URL is only a read URL.
    [grant, *_] = StorageGrants.model_validate(a.grants(2).ask("GET", candidate["manifest_key"]).json()).grants
    assert _send(grant, method="PUT", body=b"{}") == 403
    assert _send(grant, method="DELETE") == 403
    assert _send(grant, url=grant.url.replace(a.job["id"], b.job["id"])) == 403


def test_a_shard_larger_than_a_part_goes_up_in_parts_create_only(client):
    a = Job(client, "a", nodes=1, gpus=1)
    store = object_store(client.app.state.settings)
    data = bytes(range(256)) * (11 * 2**20 // 256 + 3)  # 11 MiB and a bit: 3 parts of 5 MiB
    key = a.shard_key(10, 0)
    storage, grants = a.storage(0)
    assert storage.put_object(key, io.BytesIO(data), length=len(data)).size == len(data)
    assert hashlib.sha256(store.get_bytes(key)).digest() == hashlib.sha256(data).digest()
    assert grants.asked == [("PUT", key), ("PUT", key)]  # the create, then the parts
    # A second upload in parts onto the key gets no part grants (one upload per shard: issue 23,
    # finding 7; completing it would be refused by S3 too, create-only).
    with pytest.raises(GrantRefused) as refused:
        storage.put_object(key, io.BytesIO(data[:6 * 2**20]), length=6 * 2**20)
    assert refused.value.status == 409 and "one upload per shard" in str(refused.value)
    assert store.stat(key).size == len(data)
