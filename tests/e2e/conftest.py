"""A real local cluster for end-to-end tests: `trainyard dev up` on a fresh database and bucket,
with a real control plane and real agents running real torchrun workers."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.harness import Cluster, LiveCluster, live_cluster
from tests.helpers import ProcessReaper
from trainyard.cli.tls import client_context
from trainyard.dev.netns import Topology
from trainyard.embedded import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, fresh_database_url: str, s3_bucket: Any,
    process_reaper: ProcessReaper,
) -> Iterator[Cluster]:
    """2 nodes x 2 GPU slots; another size with ``@pytest.mark.parametrize("cluster", [{"nodes": 3,
    "gpus_per_node": 2}], indirect=True)``, control-plane settings with ``{"env": {"TRAINYARD_...": ...}}``,
    warm standbys per agent with ``{"standbys": 2}``."""
    size = {"nodes": 2, "gpus_per_node": 2, "env": {}, **getattr(request, "param", {})}
    token = secrets.token_urlsafe(16)
    port = free_port()
    log = tmp_path / "dev-up.log"
    out = log.open("w")
    proc = process_reaper.spawn(
        [sys.executable, "-m", "trainyard", "dev", "up", "--nodes", str(size["nodes"]),
         "--gpus-per-node", str(size["gpus_per_node"]),
         "--port", str(port), "--data-dir", str(tmp_path / "cluster"),
         "--database-url", fresh_database_url, "--s3-endpoint", s3_bucket.endpoint,
         "--s3-access-key", s3_bucket.access_key, "--s3-bucket", s3_bucket.bucket,
         *(["--standbys", str(size["standbys"])] if size.get("standbys") else [])],
        stdout=out, stderr=subprocess_stdout(), cwd=ROOT,
        # Secrets through the environment: never on a command line (issue 11).
        env={**os.environ, **size["env"], "TRAINYARD_TOKEN": token, "TRAINYARD_S3_SECRET_KEY": s3_bucket.secret_key},
    )
    deadline = time.monotonic() + 120
    while "TRAINYARD_READY" not in log.read_text():
        assert proc.poll() is None, f"dev up exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"dev up not ready:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    # dev up serves HTTPS by default: the ready line names the URL and the CA its certificate is from.
    ready = dict(f.split("=", 1) for f in log.read_text().split("TRAINYARD_READY ", 1)[1].split("\n")[0].split())
    assert ready["url"] == f"https://127.0.0.1:{port}", ready
    verify = client_context(ready["ca"])
    http = httpx.Client(base_url=ready["url"], headers={"Authorization": f"Bearer {token}"}, timeout=30,
                        verify=verify)
    try:
        yield Cluster(url=ready["url"], token=token, http=http, log=log, verify=verify)
    finally:
        http.close()
        # dev up stops its agents, then the rest, with 10 s of grace each; killed sooner (the
        # reaper's default is 5 s), it would leave them running, each in its own session.
        process_reaper.grace_s = 30
        process_reaper.reap()
        out.close()


def subprocess_stdout() -> int:
    import subprocess

    return subprocess.STDOUT


# Fault tests: failures are detected in seconds, not the production defaults' tens of seconds.
FAST_SETTINGS = {
    "TRAINYARD_NODE_LOST_TIMEOUT_S": "4",
    "TRAINYARD_STARTUP_GRACE_S": "6",
    "TRAINYARD_CHECKPOINT_MAINTENANCE_INTERVAL_S": "0.5",
}


@pytest.fixture
def make_cluster(tmp_path: Path, fresh_database_url: str, s3_bucket: Any) -> Iterator[Callable[..., LiveCluster]]:
    """``make_cluster(nodes=3, gpus_per_node=1, settings={...}, proxy_s3=False, proxy_agents=())``: a
    cluster run in this process, whose agents, workers, control plane, S3 connection and agents'
    connections to the control plane the test can break."""
    with contextlib.ExitStack() as stack:
        def make(*, nodes: int = 3, gpus_per_node: int = 1, settings: dict[str, str] | None = None,
                 proxy_s3: bool = False, replicas: int = 1, proxy_agents: tuple[str, ...] = (),
                 network: Topology | None = None) -> LiveCluster:
            return stack.enter_context(live_cluster(
                tmp_path, fresh_database_url, s3_bucket, nodes=nodes, gpus_per_node=gpus_per_node,
                settings={**FAST_SETTINGS, **(settings or {})}, proxy_s3=proxy_s3, replicas=replicas,
                proxy_agents=proxy_agents, network=network,
            ))
        yield make


_reference: dict[tuple[str, ...], dict[str, Any]] = {}
# tiny_gpt flags that change timing or inject faults, never the weights.
_NOT_MODEL = {"--step-delay-s", "--ckpt-upload-delay-s", "--ckpt-slow-rank", "--crash-at-step", "--crash-rank",
              "--slow-rank", "--slow-busy-s"}
_NOT_MODEL_FLAGS = {"--crash-kill", "--crash-once"}


def _model_args(args: list[str]) -> list[str]:
    out, it = [], iter(args)
    for a in it:
        if a in _NOT_MODEL:
            next(it, None)
        elif a not in _NOT_MODEL_FLAGS:
            out.append(a)
    return out


@pytest.fixture(scope="session")
def reference_result(tmp_path_factory: pytest.TempPathFactory) -> Callable[[list[str]], dict[str, Any]]:
    """tiny_gpt's result for ``args`` on 2 ranks under bare torchrun, with no failure: what any run
    of the same arguments and world size must end with. Computed once per argument list for the
    whole session: pytest-xdist's workers share it through a file beside their temp dirs (each
    run costs about 12 CPU-s), one lock per argument list. The learning-rate schedule depends on
    ``--steps``, so each step count is a run of its own: the tests keep to 80, 120 or 160 steps and
    set their duration with ``--step-delay-s``, which changes no weight."""
    from tests.worker_runtime.torchrun import run_torchrun

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base

    def get(args: list[str]) -> dict[str, Any]:
        key = tuple(_model_args(args))
        if key not in _reference:
            name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
            stored = shared / f"tiny-gpt-reference-{name}.json"
            with (shared / f"tiny-gpt-reference-{name}.lock").open("w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not stored.exists():
                    reaper = ProcessReaper()
                    try:
                        result, _ = run_torchrun(reaper, ["worker_runtime.examples.tiny_gpt", *key],
                                                 {"TRAINYARD_DEVICE": "cpu"})
                    finally:
                        reaper.reap()
                    stored.write_text(json.dumps(result))
                _reference[key] = json.loads(stored.read_text())
        return _reference[key]
    return get
