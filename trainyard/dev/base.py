"""The state of one ``dev up`` and what its parts share: starting a child process (with its log,
its own session and none of dev up's secrets), waiting for something while watching the children,
saying what happens, the client-side TLS trust. DevCluster (trainyard/dev/cluster.py) builds on it."""

from __future__ import annotations

import contextlib
import os
import secrets
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from trainyard.cli.tls import client_context
from trainyard.dev.certs import ServerTls
from trainyard.dev.config import SECRET_ENV, DevConfig, DevError, _Interrupted
from trainyard.dev.netns import Network
from trainyard.dev.processes import Child, descendants, exit_code, record_pid
from trainyard.embedded import EmbeddedPostgres, EmbeddedS3, has_exited


class ClusterBase:
    """The processes of one ``dev up`` and the helpers every part of it uses."""

    def __init__(self, config: DevConfig, out: IO[str] | None = None) -> None:
        self.config = config
        self.out = out or sys.stdout
        self.token = config.token or secrets.token_urlsafe(24)
        self.logs_dir = config.data_dir / "logs"
        self.pg: EmbeddedPostgres | None = None
        self.s3: EmbeddedS3 | None = None
        self.database_url = config.database_url or ""
        self.tls: ServerTls | None = None
        """The CA and server certificate, once ``start`` made them (None over plain HTTP)."""
        self.control_planes: list[Child | None] = [None] * config.replicas
        self.agents: list[Child] = []
        self.network: Network | None = None
        """The nodes' network namespaces and links (``--netns``), built first and removed last."""
        self._control_plane_env: dict[str, str] = {}
        self._stop_requested = threading.Event()
        self._descendants: dict[tuple[int, float], Any] = {}
        self._stopped = False
        self._reported_dead: set[str] = set()

    def request_stop(self) -> None:
        self._stop_requested.set()

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an HTTP client of this cluster verifies its certificate with (httpx's ``verify``)."""
        return client_context(self.tls.ca_file) if self.tls else True

    # -- helpers ------------------------------------------------------------------------------------

    def _children(self) -> list[Child]:
        return [*(cp for cp in self.control_planes if cp is not None), *self.agents]

    def _scan_descendants(self) -> None:
        """Remember every process our children started, to end any that outlive them."""
        for child in self._children():
            if not has_exited(child.proc):
                for proc in descendants(child.proc.pid):
                    with contextlib.suppress(Exception):
                        self._descendants[(proc.pid, proc.create_time())] = proc

    def _say(self, message: str) -> None:
        print(f"dev: {message}", file=self.out, flush=True)

    def _print_tail(self, path: Path, lines: int = 15) -> None:
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            for line in tail:
                print(f"  | {line}", file=sys.stderr)

    def _check_interrupted(self) -> None:
        if self._stop_requested.is_set():
            raise _Interrupted

    def _spawn(self, name: str, args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> Child:
        """Start ``python args`` (after ``prefix``: a node's network namespace) with its log."""
        log_path = self.logs_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in _stop_children
        # The user's secrets stay with dev up: each child gets only those given it in `env`.
        inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        full_env = {**inherited, **env, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [*(prefix or []), self.config.python, *args],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C at the terminal reaches only us, and we stop the children
            # in order; and stop() can signal each child's whole process group.
            start_new_session=True,
        )
        child = Child(name, proc, log_path, log)
        record_pid(self.config.data_dir / "dev-up.pids", child)
        return child

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            self._check_interrupted()
            for child in self._children():
                if has_exited(child.proc):
                    self._print_tail(child.log_path)
                    raise DevError(
                        f"{child.name} exited with code {exit_code(child.proc)} while waiting for {what}; "
                        f"log: {child.log_path}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                waited = self.config.ready_timeout_s
                raise DevError(f"timed out after {waited:.0f}s waiting for {what}; logs: {self.logs_dir}")
            self._stop_requested.wait(0.25)
