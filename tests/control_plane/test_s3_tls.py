"""S3 over HTTPS with a private CA (issue 11, finding 4), on a real control plane, PostgreSQL and a
SeaweedFS serving its S3 API with a certificate from a CA of the test's own (trainyard.dev.certs, the
dev cluster's CA code).

The operator gives the CA once (TRAINYARD_S3_CA_FILE): the control plane verifies S3 with it
(commits list and write there), agents get it at registration and hand it to workers
(TRAINYARD_S3_CA_PEM, no credential), and a worker's save and restore through presigned https URLs
work. Without it every side fails in one line that names the setting: a worker's save raises, a
control-plane route that needs S3 answers 503 (never 500), a commit waits.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.settings import Settings
from node_agent.part.commands import AttemptPaths, NodeContext, worker_env
from tests.control_plane.test_storage_grants import Job
from trainyard.dev.certs import ensure_server_tls
from trainyard.embedded.s3 import EmbeddedS3, S3Endpoint
from trainyard.protocol.agent import LaunchSpec
from trainyard.protocol.env import ENV_S3_CA_PEM
from worker_runtime.checkpoint.presigned import PresignedStorage, StorageTlsError


@pytest.fixture(scope="module")
def tls_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    base = tmp_path_factory.mktemp("s3-tls")
    tls = ensure_server_tls(base / "ca", ["127.0.0.1"], common_name="trainyard test S3")
    server = EmbeddedS3(base / "s3", access_key="tls-test", secret_key=secrets.token_urlsafe(24),
                        tls=(tls.ca_file, tls.cert_file, tls.key_file))
    try:
        assert server.info.url.startswith("https://")
        yield server.info
    finally:
        server.stop()


def _client(settings: Settings, s3: S3Endpoint, *, ca: bool) -> TestClient:
    # Validated as from the environment: the https:// endpoint is what turns TLS on.
    values = {**settings.model_dump(), "s3_endpoint": s3.url, "s3_access_key": s3.access_key,
              "s3_secret_key": s3.secret_key, "s3_bucket": s3.bucket, "s3_ca_file": s3.ca_file if ca else ""}
    return TestClient(create_app(Settings(**values)))


def _worker_ca(spec: dict[str, Any], tmp_path: Path) -> str | None:
    """TRAINYARD_S3_CA_PEM as the agent's launcher gives it to the spec's workers."""
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.2:1", virtual=True, base_env={})
    return worker_env(LaunchSpec.model_validate(spec), node, AttemptPaths(tmp_path)).get(ENV_S3_CA_PEM)


def test_save_and_restore_over_https_with_the_operators_ca(settings: Settings, tls_s3: S3Endpoint,
                                                           tmp_path: Path) -> None:
    ca_pem = Path(tls_s3.ca_file).read_text()
    with _client(settings, tls_s3, ca=True) as client:
        assert client.app.state.settings.s3_secure  # from the https:// endpoint
        job = Job(client, "tls", nodes=1, gpus=1)
        # The CA reached the worker's environment through the registration and the launch spec.
        assert job.specs[0]["storage"]["ca_pem"] == ca_pem
        worker_ca = _worker_ca(job.specs[0], tmp_path)
        assert worker_ca == ca_pem
        storage = PresignedStorage(job.grants(0), ca_pem=worker_ca)
        data = b"weights of rank 0 " * 100
        key = job.shard_key(10, 0)
        assert storage.put_object(key, io.BytesIO(data), length=len(data)).size == len(data)
        # The commit lists the step's shards and writes the manifest in S3 over the same TLS.
        assert job.save(10, 0, data, upload=False)["committed_steps"] == [10]

        [candidate] = job.fail_and_recover()["candidates"]
        storage = PresignedStorage(job.grants(0), ca_pem=_worker_ca(job.specs[0], tmp_path))
        manifest = json.loads(storage.get_object(candidate["manifest_key"]).read())
        [shard] = manifest["shards"]
        restored = storage.get_object(shard["key"]).read()
        assert restored == data and hashlib.sha256(restored).hexdigest() == shard["sha256"]


def test_without_the_ca_every_side_fails_in_one_line(settings: Settings, tls_s3: S3Endpoint) -> None:
    # A worker that was not given the CA: its save fails at once, saying what to set.
    with _client(settings, tls_s3, ca=True) as client:
        job = Job(client, "untrusting", nodes=1, gpus=1)
        with pytest.raises(StorageTlsError) as refused:
            PresignedStorage(job.grants(0)).put_object(job.shard_key(10, 0), io.BytesIO(b"x"), length=1)
        message = str(refused.value)
        assert "\n" not in message and "not trusted" in message and "TRAINYARD_S3_CA_FILE" in message
        assert tls_s3.endpoint in message

    # A control plane that was not given it: a route that needs S3 answers 503 in one line.
    with _client(settings, tls_s3, ca=False) as client:
        assert "ca_pem" not in client.app.state.worker_storage
        admin = {"Authorization": f"Bearer {settings.admin_token}"}
        archive = gzip.compress(b"code")
        r = client.put(f"/v1/code/{hashlib.sha256(archive).hexdigest()}", content=archive, headers=admin)
        assert r.status_code == 503, r.text
        problem = r.json()
        assert problem["type"].endswith("/storage-unavailable")
        assert "not trusted" in problem["detail"] and "TRAINYARD_S3_CA_FILE" in problem["detail"]
        assert "\n" not in problem["detail"]
        # The shard is in S3 (its worker trusts the CA), but the commit cannot list it: the checkpoint
        # stays pending (the maintenance loop retries), no 500.
        job = Job(client, "blind", nodes=1, gpus=1)
        PresignedStorage(job.grants(0), ca_pem=Path(tls_s3.ca_file).read_text()).put_object(
            job.shard_key(10, 0), io.BytesIO(b"x"), length=1)
        assert job.save(10, 0, b"x", upload=False)["committed_steps"] == []
        [checkpoint] = client.get(f"/v1/jobs/{job.job['id']}/checkpoints", headers=admin).json()["items"]
        assert checkpoint["state"] == "pending"


def test_a_ca_file_that_does_not_load_is_refused_at_start(settings: Settings, tmp_path: Path) -> None:
    bogus = tmp_path / "ca.pem"
    bogus.write_text("not a certificate\n")
    values = {**settings.model_dump(), "s3_endpoint": "https://127.0.0.1:9", "s3_ca_file": str(bogus)}
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        Settings(**values)
    with pytest.raises(ValueError, match="needs S3 over HTTPS"):
        Settings(**{**values, "s3_endpoint": "http://127.0.0.1:9"})


def test_dev_up_uses_an_https_s3_with_its_ca(tls_s3: S3Endpoint, tmp_path: Path) -> None:
    """`trainyard dev up --s3-endpoint https://... --s3-ca-file CA` checks the bucket over TLS and
    hands the CA to its control plane; without the CA it stops in one line."""
    from trainyard.dev import DevCluster, DevConfig, DevError

    common = {"data_dir": tmp_path, "s3_endpoint": tls_s3.url, "s3_access_key": tls_s3.access_key,
              "s3_secret_key": tls_s3.secret_key, "s3_bucket": tls_s3.bucket}
    trusting = DevCluster(DevConfig(**common, s3_ca_file=Path(tls_s3.ca_file)))
    trusting._ensure_bucket(tls_s3.url, tls_s3.access_key, tls_s3.secret_key)
    with pytest.raises(DevError) as refused:
        DevCluster(DevConfig(**common))._ensure_bucket(tls_s3.url, tls_s3.access_key, tls_s3.secret_key)
    assert "not trusted" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="needs an https://"):
        DevConfig(**{**common, "s3_endpoint": f"http://{tls_s3.endpoint}"}, s3_ca_file=Path(tls_s3.ca_file))
