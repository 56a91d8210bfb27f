"""Storage bounds (issue 23, finding 7), as attacks on a real control plane, PostgreSQL and
SeaweedFS: a worker asks for grants it should not get (a far-future step, a shard larger than its
job's, more saves than one in flight) and sends more bytes than it was granted (S3 itself refuses
them: the grant signs Content-Length); what it was granted but never reported is deleted once its
attempt ends, while committed checkpoints stay."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest
import urllib3
from fastapi.testclient import TestClient

from control_plane.app import create_app, object_store
from control_plane.models import StoragePutGrant
from control_plane.settings import Settings
from tests.control_plane.test_storage_grants import Job, _send
from trainyard.protocol.grants import StorageGrants

HTTP = urllib3.PoolManager(retries=False)
MIB = 2**20


@pytest.fixture
def client(settings: Settings, s3_bucket) -> Any:
    s3 = settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, "storage_part_size_mb": 5,
        "storage_open_saves": 2, "storage_shard_growth": 4.0,
    })
    with TestClient(create_app(s3)) as c:
        yield c


def _problem(r, status: int, slug: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert r.headers["content-type"].startswith("application/problem+json") and body["type"].endswith(slug), body
    return body


def _create_upload(grants: StorageGrants) -> str:
    [create] = grants.grants
    resp = HTTP.request(create.method, create.url, headers=create.headers)
    assert resp.status == 200, resp.data
    found = re.search(rb"<UploadId>([^<]+)</UploadId>", resp.data)
    assert found is not None
    return found[1].decode()


def test_grant_abuse_is_refused_by_the_control_plane_or_by_s3(client):
    store = object_store(client.app.state.settings)
    a = Job(client, "a", nodes=1, gpus=2)
    worker = a.grants(0)

    # A far-future step: not the attempt's current save.
    far = _problem(worker.ask("PUT", a.shard_key(50_000_000, 0), size_bytes=8), 403, "step-out-of-reach")
    assert "storage_step_lead" in far["detail"]
    # A shard larger than any shard may be (the operator's cap, 256 GiB by default).
    huge = _problem(worker.ask("PUT", a.shard_key(10, 0), size_bytes=300 * 2**30), 422, "shard-too-large")
    assert "storage_max_shard_gb" in huge["detail"] and huge["limit_bytes"] == 256 * 2**30

    # A body bigger than the grant is refused by S3 itself (403: the signed Content-Length), and a
    # smaller one too; nothing is stored. The exact size goes in.
    key = a.shard_key(10, 0)
    [put] = StorageGrants.model_validate(worker.ask("PUT", key, size_bytes=8).json()).grants
    assert put.headers["Content-Length"] == "8"
    bigger = {**put.headers, "Content-Length": str(64 * MIB)}
    assert _send(put, body=b"\0" * (64 * MIB), headers=bigger) == 403
    assert _send(put, body=b"\0" * 4, headers={**put.headers, "Content-Length": "4"}) == 403
    assert store.stat(key) is None
    assert _send(put, body=b"genuine!") == 200 and store.stat(key).size == 8

    # The same in parts: each part's size is signed (5 MiB parts here; the last one is 1 MiB).
    key1 = a.shard_key(10, 1)
    parted = a.grants(1)
    upload_id = _create_upload(StorageGrants.model_validate(parted.ask("PUT", key1, size_bytes=6 * MIB).json()))
    grants = StorageGrants.model_validate(parted.ask("PUT", key1, size_bytes=6 * MIB, upload_id=upload_id).json())
    last = next(g for g in grants.grants if g.part_number == 2)
    assert last.headers["Content-Length"] == str(MIB)
    assert _send(last, body=b"\0" * (5 * MIB), headers={**last.headers, "Content-Length": str(5 * MIB)}) == 403
    assert _send(last, body=b"\0" * MIB) == 200
    # One upload in parts per shard: parts of a second upload id are not granted.
    other = _create_upload(StorageGrants.model_validate(parted.ask("PUT", key1, size_bytes=6 * MIB).json()))
    _problem(parted.ask("PUT", key1, size_bytes=6 * MIB, upload_id=other), 409, "conflict")

    # At most storage_open_saves (2) undecided steps at once: step 10 is open, 20 may be, 30 not.
    assert worker.ask("PUT", a.shard_key(20, 0), size_bytes=8).status_code == 200
    _problem(worker.ask("PUT", a.shard_key(30, 0), size_bytes=8), 409, "too-many-open-saves")

    # Once the job has committed a checkpoint, a shard may be at most 4 x its largest one (at
    # least 64 MiB): step 10 commits with 8-byte shards, so 65 MiB is refused and 1 MiB is not.
    a.save(10, 0, b"genuine!", upload=False)
    a.save(10, 1, b"rank one")
    grown = _problem(worker.ask("PUT", a.shard_key(40, 0), size_bytes=65 * MIB), 422, "shard-too-large")
    assert grown["limit_bytes"] == 64 * MIB and "largest committed shard" in grown["detail"]
    assert worker.ask("PUT", a.shard_key(40, 0), size_bytes=MIB).status_code == 200


def test_what_was_granted_but_never_reported_is_deleted_when_the_attempt_ends(client):
    store = object_store(client.app.state.settings)
    loops = client.app.state.loops
    a = Job(client, "a", nodes=1, gpus=2)
    kept = {rank: f"rank {rank} kept".encode() for rank in (0, 1)}
    for rank, data in kept.items():
        a.save(5, rank, data)  # committed: stays
    kept_keys = {a.shard_key(5, rank): data for rank, data in kept.items()}
    lost = a.shard_key(10, 0)  # uploaded, never reported
    storage, _ = a.storage(0)
    storage.put_object(lost, io.BytesIO(b"orphan!!"), length=8)
    # An upload in parts left half done: one part in storage, never completed.
    half = a.shard_key(10, 1)
    parted = a.grants(1)
    upload_id = _create_upload(StorageGrants.model_validate(parted.ask("PUT", half, size_bytes=6 * MIB).json()))
    grants = StorageGrants.model_validate(parted.ask("PUT", half, size_bytes=6 * MIB, upload_id=upload_id).json())
    first = next(g for g in grants.grants if g.part_number == 1)
    assert _send(first, body=b"\1" * (5 * MIB)) == 200
    list_parts = store.presign("GET", half, expires_s=60, query={"uploadId": upload_id})
    assert HTTP.request("GET", list_parts).status == 200

    # While the attempt runs, nothing is touched.
    loops.checkpoints_once()
    assert store.stat(lost) is not None
    with client.app.state.session_factory() as s:
        assert s.query(StoragePutGrant).count() == 2  # the committed step's grants are the checkpoint's now

    a.fail_and_recover()
    loops.checkpoints_once()
    assert store.stat(lost) is None
    assert HTTP.request("GET", list_parts).status == 404  # NoSuchUpload: its part is gone
    for key, data in kept_keys.items():
        assert store.get_bytes(key) == data
    with client.app.state.session_factory() as s:
        assert s.query(StoragePutGrant).count() == 0


@pytest.mark.parametrize("step", [2**31, 10**12])
def test_a_step_past_what_the_database_stores_is_refused_not_a_500(client, step):
    a = Job(client, "a", nodes=1, gpus=1)
    _problem(a.grants(0).ask("PUT", a.shard_key(step, 0), size_bytes=8), 403, "step-out-of-reach")
