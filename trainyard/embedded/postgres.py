"""PostgreSQL: an admin for any server (create, template and drop databases) and the embedded one
(pgserver), listening on a unix socket in its data directory."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
import warnings
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import urlsplit, urlunsplit

if TYPE_CHECKING:
    pass
from trainyard.embedded.processes import EmbeddedError, _pid_alive, _wait_gone


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
    path is too long for a socket). pgserver initialises it with trust authentication; once it is
    up, ``_peer_auth_only`` replaces that with peer authentication: only this process's OS user
    (and pgserver's system user) may connect, as ``postgres``. Any other local user, such as the
    unprivileged users workers run as, is refused even where it can reach the socket.

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
        try:
            self._peer_auth_only()
        except Exception:
            self.stop()
            raise

    def _peer_auth_only(self) -> None:
        """No trust authentication (issue 11, finding 13): peer authentication on the socket, the
        connecting OS user mapped to ``postgres`` only for our own user and pgserver's. pgserver
        always runs initdb with --auth=trust, so the files are rewritten (idempotent) and reloaded."""
        import getpass

        import psycopg

        users = {getpass.getuser(), *([self._server.system_user] if self._server.system_user else [])}
        hba = self.data_dir / "pg_hba.conf"
        ident = self.data_dir / "pg_ident.conf"
        wanted_hba = "# Written by trainyard.embedded: peer authentication only, no trust.\n" \
                     "local all all peer map=trainyard\n"
        wanted_ident = "".join(f"trainyard {user} postgres\n" for user in sorted(users))
        if hba.read_text() == wanted_hba and ident.read_text().endswith(wanted_ident):
            return
        ident.write_text("# Written by trainyard.embedded.\n" + wanted_ident)
        hba.write_text(wanted_hba)
        info = self._server.get_postmaster_info()
        with psycopg.connect(host=str(info.socket_dir), port=info.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")

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

    def restart(self, *, down_s: float = 0.0, timeout: float = 20.0) -> None:
        """Stop the server (fast shutdown: every session is cut), stay down ``down_s``, and start
        it again on the same socket and port with the same data. For fault tests."""
        if self._server is None:
            raise EmbeddedError("the server is not running")
        from pgserver._commands import POSTGRES_BIN_PATH

        # The options the server was started with (socket dir, listen address, port), minus -D.
        opts = shlex.split((self.data_dir / "postmaster.opts").read_text())[1:]
        options = [a for i, a in enumerate(opts) if a != "-D" and (i == 0 or opts[i - 1] != "-D")]
        pg_ctl = [str(POSTGRES_BIN_PATH / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t", str(int(timeout))]

        def run(*args: str) -> None:
            subprocess.run([*pg_ctl, *args], user=self._server.system_user, check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout + 5)

        run("-m", "fast", "stop")
        time.sleep(down_s)
        run("-l", str(self.data_dir / "log"), "-o", shlex.join(options), "start")
        self._pid = int((self.data_dir / "postmaster.pid").read_text().splitlines()[0])

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"EmbeddedPostgres(data_dir={str(self.data_dir)!r}, pid={self._pid})"


def _is_postgres_of(pid: int, data_dir: Path) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and str(data_dir) in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
