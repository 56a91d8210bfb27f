"""Helpers for the node agent tests: real torchrun launches, all killed at teardown."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any, BinaryIO

from node_agent.part.attempt import Part, attempt_paths
from node_agent.part.code import CodeLimits, ShippedCode
from node_agent.part.commands import NodeContext
from tests.helpers import free_port, rendezvous_port, wait_for
from trainyard.protocol.agent import CodeRef, LaunchSpec

__all__ = ["REPO_ROOT", "free_port", "wait_for", "make_spec", "write_script", "Launcher", "read_log", "wait_finished"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_spec(**overrides: Any) -> LaunchSpec:
    attempt_id = overrides.pop("attempt_id", f"att-{uuid.uuid4().hex[:12]}")
    fields: dict[str, Any] = {
        "job_id": "job-1",
        "job_name": "test-job",
        "attempt_id": attempt_id,
        "attempt_number": 1,
        "fencing_token": f"fence-{attempt_id}",
        "node_rank": 0,
        "nnodes": 1,
        "nproc_per_node": 2,
        "gpu_indices": [0, 1],
        "rdzv_host": "127.0.0.2",
        "rdzv_port": rendezvous_port("127.0.0.2"),
        "entrypoint": "train.py",
        "checkpoint": {"every_steps": 10},
    }
    fields.update(overrides)
    return LaunchSpec(**fields)


def write_script(directory: Path, name: str, body: str) -> Path:
    path = directory / name
    path.write_text(body)
    return path


class Launcher:
    """Launches Parts for a test and kills whatever is left of them at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.runs: list[Part] = []

    def node(self, address: str = "127.0.0.2", **overrides: Any) -> NodeContext:
        fields: dict[str, Any] = {
            "local_addr": address,
            "agent_url": "http://127.0.0.1:9",
            "virtual": True,
            "join_timeout_s": 60,
            "shutdown_timeout_s": 2,
            "monitor_interval_s": 0.2,
            "cwd": str(self.tmp_path),
        }
        fields.update(overrides)
        return NodeContext(**fields)

    def launch(
        self, spec: LaunchSpec, node: NodeContext | None = None, *, work_dir: Path | None = None, grace: float = 2.0
    ) -> Part:
        node = node or self.node()
        paths = attempt_paths(work_dir or self.tmp_path / f"node-{node.local_addr}", spec.attempt_id)
        run = Part.launch(spec, node, paths, stop_grace_s=grace)
        self.runs.append(run)
        return run

    def launch_with_code(self, spec: LaunchSpec, archive: Path, node: NodeContext | None = None) -> Part:
        """Launch as the agent does for a job with shipped code (node_agent/part/code.py)."""
        node = node or self.node()
        paths = attempt_paths(self.tmp_path / f"node-{node.local_addr}", spec.attempt_id)
        run = Part.launch(spec, node, paths, stop_grace_s=2.0, code=local_code(archive, self.tmp_path / "cache"))
        self.runs.append(run)
        return run

    def cleanup(self) -> None:
        for run in self.runs:
            run.kill_now()
            if run.pgid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for run in self.runs:
            while time.monotonic() < deadline:
                run.poll()
                if not run.alive:
                    break
                time.sleep(0.05)


def local_code(archive: Path, work_dir: Path, limits: CodeLimits = CodeLimits()) -> ShippedCode:
    """A job's code as an agent gets it, fetched from a local file instead of the control plane."""
    data = archive.read_bytes()

    def fetch(out: BinaryIO, max_bytes: int, deadline: float) -> None:
        assert len(data) <= max_bytes
        out.write(data)

    return ShippedCode(CodeRef(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data)), work_dir, fetch, limits)


def wait_finished(run: Part, timeout: float = 30.0) -> Part:
    def finished() -> bool:
        run.poll()
        return run.finished

    wait_for(finished, timeout=timeout, interval=0.1, what=f"attempt {run.attempt_id} to finish")
    return run


def read_log(run: Part, rank: int, stream: str = "stdout") -> str:
    return (run.paths.log_dir / f"rank-{rank}" / f"{stream}.log").read_text()
