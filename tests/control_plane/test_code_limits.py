"""Code archives bounded (issue 23, findings 7 and 8), on a real control plane, PostgreSQL and
SeaweedFS: an upload streams to storage (a 200 MiB body leaves the replica's memory nearly where it
was), a principal's concurrent uploads past its limit get 429 with Retry-After, a tenant over its
code quota gets a problem+json that names the quota (and nothing is stored), and archives no job
needs any more are deleted."""

from __future__ import annotations

import hashlib
import io
import random
import tarfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import urllib3
from fastapi.testclient import TestClient

from control_plane.app import create_app, object_store
from control_plane.clock import wall
from control_plane.services.runs.code import code_key
from control_plane.settings import Settings
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, FakeAgentSession, job_body

MIB = 2**20
GZ = {**ADMIN, "Content-Type": "application/octet-stream"}
BLOCK = random.Random(23).randbytes(MIB)


def _s3(settings: Settings, s3_bucket: Any, **extra: Any) -> Settings:
    return settings.model_copy(update={
        "s3_endpoint": s3_bucket.endpoint, "s3_access_key": s3_bucket.access_key,
        "s3_secret_key": s3_bucket.secret_key, "s3_bucket": s3_bucket.bucket, **extra})


def _archive(text: str, pad: int = 0) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        data = text.encode() + random.Random(text).randbytes(pad)  # incompressible padding
        info = tarfile.TarInfo("train.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def _generated(mib: int, gate: threading.Event | None = None) -> Iterator[bytes]:
    """``mib`` MiB that start like a gzip archive, made as they are sent (never whole in memory)."""
    yield b"\x1f\x8b" + BLOCK[2:]
    if gate is not None:
        assert gate.wait(60)
    for _ in range(mib - 1):
        yield BLOCK


def _sha(mib: int) -> str:
    digest = hashlib.sha256()
    for chunk in _generated(mib):
        digest.update(chunk)
    return digest.hexdigest()


def _problem(r: Any, status: int, slug: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["type"].endswith(slug), body
    return body


def test_a_200_mib_upload_streams_to_storage_in_bounded_memory(settings, s3_bucket):
    app = create_app(_s3(settings, s3_bucket))
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=10, read=300))
    mib = 200
    sha = _sha(mib)
    with serve(app) as url:
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            r = http.request("PUT", f"{url}/v1/code/{sha}", body=_generated(mib),
                             headers={**GZ, "Content-Length": str(mib * MIB)}, preload_content=True)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert r.status == 201, r.data
        print(f"200 MiB code upload: Python heap peak {peak / MIB:.1f} MiB above the start")
        # The replica (and this client) held a few parts at most, never the body.
        assert peak < 40 * MIB, f"peak {peak / MIB:.1f} MiB for a {mib} MiB body"
        info = object_store(app.state.settings).stat(code_key("default", sha))
        assert info is not None and info.size == mib * MIB
        # A body that does not hash to its name is never stored (the upload in parts is aborted).
        wrong = "0" * 64
        r = http.request("PUT", f"{url}/v1/code/{wrong}", body=_generated(20),
                         headers={**GZ, "Content-Length": str(20 * MIB)})
        assert r.status == 422 and b"sha256" in r.data
        assert object_store(app.state.settings).stat(code_key("default", wrong)) is None


def test_uploads_past_a_principals_limit_get_429(settings, s3_bucket):
    app = create_app(_s3(settings, s3_bucket, code_uploads_per_principal=2))
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=10, read=120))
    gate = threading.Event()
    results: list[int] = []

    def slow_upload() -> None:  # sends its first MiB, then waits for the gate
        r = http.request("PUT", f"{url}/v1/code/{_sha(9)}", body=_generated(9, gate),
                         headers={**GZ, "Content-Length": str(9 * MIB)})
        results.append(r.status)

    with serve(app) as url:
        threads = [threading.Thread(target=slow_upload) for _ in range(2)]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 30
            while app.state.code_uploads.held("admin") < 2:
                assert time.monotonic() < deadline, "the two uploads never started"
                time.sleep(0.05)
            small = _archive("print('third')\n")
            third = http.request("PUT", f"{url}/v1/code/{hashlib.sha256(small).hexdigest()}", body=small,
                                 headers=GZ)
            assert third.status == 429 and int(third.headers["Retry-After"]) >= 1
            assert third.headers["content-type"].startswith("application/problem+json")
            assert b"code_uploads_per_principal" in third.data
        finally:
            gate.set()
            for t in threads:
                t.join(120)
        assert len(results) == 2 and set(results) <= {200, 201}  # the same archive twice: stored under one key
        assert app.state.code_uploads.held("admin") == 0
        again = http.request("PUT", f"{url}/v1/code/{hashlib.sha256(small).hexdigest()}", body=small, headers=GZ)
        assert again.status == 201


def test_a_tenant_over_its_code_quota_is_refused_with_the_quota_named(settings, s3_bucket):
    with TestClient(create_app(_s3(settings, s3_bucket, code_quota_archives=2, code_quota_gb=0.004))) as client:
        store = object_store(client.app.state.settings)
        archives = [_archive(f"print({i})\n") for i in range(3)]
        shas = [hashlib.sha256(a).hexdigest() for a in archives]
        for data, sha in zip(archives[:2], shas[:2], strict=True):
            assert client.put(f"/v1/code/{sha}", content=data, headers=GZ).status_code == 201
        body = _problem(client.put(f"/v1/code/{shas[2]}", content=archives[2], headers=GZ), 409, "code-quota")
        assert body["quota"] == "code_quota_archives" and body["limit"] == 2 and body["used"] == 2
        assert "code_quota_archives=2" in body["detail"]
        assert store.stat(code_key("default", shas[2])) is None
        # An archive already stored is no new archive: uploading it again is fine.
        assert client.put(f"/v1/code/{shas[0]}", content=archives[0], headers=GZ).status_code == 200

        # Bytes: 4 MiB of quota (0.004 GiB); a 5 MiB archive is refused from its Content-Length,
        # and, sent without one, as it streams past the quota.
        big = _archive("print('big')\n", pad=5 * MIB)
        sha = hashlib.sha256(big).hexdigest()
        for content in (big, iter([big[i:i + MIB] for i in range(0, len(big), MIB)])):
            r = client.put(f"/v1/code/{sha}", params={"tenant": "nlp"}, content=content, headers=GZ)
            body = _problem(r, 413, "code-quota")
            assert body["quota"] == "code_quota_gb" and "code_quota_gb=0.004" in body["detail"]
        assert store.stat(code_key("nlp", sha)) is None


def test_archives_no_job_needs_are_deleted(settings, s3_bucket, clock):
    with TestClient(create_app(_s3(settings, s3_bucket, code_unreferenced_days=7))) as client:
        store = object_store(client.app.state.settings)
        named, orphan = _archive("print('named')\n"), _archive("print('orphan')\n")
        for data in (named, orphan):
            assert client.put(f"/v1/code/{hashlib.sha256(data).hexdigest()}", content=data,
                              headers=GZ).status_code == 201
        named_key, orphan_key = (code_key("default", hashlib.sha256(d).hexdigest()) for d in (named, orphan))
        FakeAgentSession(client, "node-1", 2)  # registered, never scheduled: the job stays queued
        job = client.post("/v1/jobs", json=job_body(num_nodes=1, code={"sha256": hashlib.sha256(named).hexdigest()}),
                          headers=ADMIN).json()
        assert job.get("state") == "queued", job
        client.app.state.loops.retention_once()
        assert store.stat(orphan_key) is not None  # young: kept

        clock.t = wall() + timedelta(days=8)
        client.app.state.loops.retention_once()
        assert store.stat(orphan_key) is None
        assert store.stat(named_key) is not None  # its job is queued
        assert client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code in (200, 202)
        client.app.state.loops.retention_once()
        assert store.stat(named_key) is not None  # its job ended only now
        clock.advance(8 * 86400)
        client.app.state.loops.retention_once()
        assert store.stat(named_key) is None


@pytest.fixture(autouse=True)
def _no_leftover_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]
    assert not leaked, leaked
