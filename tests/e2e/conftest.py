"""A real local cluster for end-to-end tests: `trainyard dev up` on a fresh database and bucket,
with a real control plane and real agents running real torchrun workers."""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ProcessReaper
from trainyard.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Cluster:
    url: str
    token: str
    http: httpx.Client
    log: Path

    def get(self, path: str, **kw: Any) -> Any:
        r = self.http.get(path, **kw)
        r.raise_for_status()
        return r.json()

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/jobs/{job_id}")

    def wait_for(self, what: str, check: Callable[[], Any], timeout: float = 120.0, every: float = 0.3) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(every)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; cluster log: {self.log}")

    def wait_state(self, job_id: str, states: set[str], timeout: float = 120.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            j = self.job(job_id)
            return j if j["state"] in states else None
        return self.wait_for(f"job {job_id} in {states}", check, timeout)


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_database_url: str, s3_bucket: Any,
    process_reaper: ProcessReaper,
) -> Iterator[Cluster]:
    """2 nodes x 2 GPU slots; another size with ``@pytest.mark.parametrize("cluster", [{"nodes": 3,
    "gpus_per_node": 2}], indirect=True)``."""
    size = {"nodes": 2, "gpus_per_node": 2, **getattr(request, "param", {})}
    token = secrets.token_urlsafe(16)
    port = free_port()
    log = tmp_path / "dev-up.log"
    out = log.open("w")
    proc = process_reaper.spawn(
        [sys.executable, "-m", "trainyard", "dev", "up", "--nodes", str(size["nodes"]),
         "--gpus-per-node", str(size["gpus_per_node"]),
         "--port", str(port), "--data-dir", str(tmp_path / "cluster"), "--token", token,
         "--database-url", fresh_database_url, "--s3-endpoint", s3_bucket.endpoint,
         "--s3-access-key", s3_bucket.access_key, "--s3-secret-key", s3_bucket.secret_key,
         "--s3-bucket", s3_bucket.bucket],
        stdout=out, stderr=subprocess_stdout(), cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while "TRAINYARD_READY" not in log.read_text():
        assert proc.poll() is None, f"dev up exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"dev up not ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                        timeout=30)
    try:
        yield Cluster(url=f"http://127.0.0.1:{port}", token=token, http=http, log=log)
    finally:
        http.close()
        process_reaper.reap()
        out.close()


def subprocess_stdout() -> int:
    import subprocess

    return subprocess.STDOUT
