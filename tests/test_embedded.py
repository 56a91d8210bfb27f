"""The embedded PostgreSQL and S3 servers (trainyard.embedded) and the shared fixtures built on them."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import psycopg
import pytest
from minio import Minio
from minio.error import S3Error

from tests.conftest import S3Bucket, postgres_base_dir
from tests.helpers import ProcessReaper, free_port, pid_gone, wait_for
from trainyard.embedded import EmbeddedPostgres, EmbeddedS3, PostgresAdmin, S3Endpoint, port_is_free

# -- PostgreSQL -------------------------------------------------------------------------------------


def test_postgres_connect_create_drop(embedded_pg: PostgresAdmin) -> None:
    url = embedded_pg.create_database("embedded_check")
    try:
        assert url.startswith("postgresql+psycopg://")
        with psycopg.connect(embedded_pg.conninfo_for("embedded_check")) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (42)")
            assert conn.execute("SELECT current_database(), x FROM t").fetchone() == ("embedded_check", 42)
    finally:
        embedded_pg.drop_database("embedded_check")
    assert not embedded_pg.database_exists("embedded_check")


def test_postgres_database_from_template(embedded_pg: PostgresAdmin) -> None:
    embedded_pg.create_database("tmpl_check")
    try:
        with psycopg.connect(embedded_pg.conninfo_for("tmpl_check")) as conn:
            conn.execute("CREATE TABLE marker (v text)")
            conn.execute("INSERT INTO marker VALUES ('from template')")
        # An open connection to the template must not stop copies from being made.
        with psycopg.connect(embedded_pg.conninfo_for("tmpl_check")):
            embedded_pg.mark_template("tmpl_check")
        embedded_pg.create_database("copy_check", template="tmpl_check")
        with psycopg.connect(embedded_pg.conninfo_for("copy_check")) as conn:
            assert conn.execute("SELECT v FROM marker").fetchone() == ("from template",)
    finally:
        embedded_pg.drop_database("copy_check")
        embedded_pg.drop_database("tmpl_check")


def test_postgres_url_works_with_sqlalchemy(embedded_pg: PostgresAdmin) -> None:
    sqlalchemy = pytest.importorskip("sqlalchemy")
    engine = sqlalchemy.create_engine(embedded_pg.url_for("postgres"))
    try:
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()


def test_postgres_stop_leaves_no_process_and_data_survives_restart() -> None:
    base = postgres_base_dir()
    try:
        _stop_and_restart(base / "pgdata")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _stop_and_restart(data_dir: Path) -> None:
    with EmbeddedPostgres(data_dir) as pg:
        pid = pg.pid
        assert pid is not None and pg.is_running()
        with psycopg.connect(pg.conninfo_for("trainyard")) as conn:
            conn.execute("CREATE TABLE kept (v int)")
            conn.execute("INSERT INTO kept VALUES (7)")
        children = psutil.Process(pid).children(recursive=True)
    assert pid_gone(pid)
    assert all(pid_gone(c.pid) for c in children)
    pg.stop()  # idempotent

    with EmbeddedPostgres(data_dir) as again:
        with psycopg.connect(again.conninfo_for("trainyard")) as conn:
            assert conn.execute("SELECT v FROM kept").fetchone() == (7,)
        assert again.pid != pid


def test_fresh_databases_are_separate(fresh_database_url: str, embedded_pg: PostgresAdmin) -> None:
    # Uses the migrated template: this errors (does not skip) until control_plane.db exists.
    name = urlsplit(fresh_database_url).path.lstrip("/")
    assert name.startswith("trainyard_test_")
    with psycopg.connect(embedded_pg.conninfo_for(name)) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert "alembic_version" in tables


# -- S3 ---------------------------------------------------------------------------------------------


def _client(endpoint: str, access_key: str, secret_key: str) -> Minio:
    return Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=False)


def test_s3_multipart_roundtrip(s3_bucket: S3Bucket) -> None:
    client = _client(s3_bucket.endpoint, s3_bucket.access_key, s3_bucket.secret_key)
    payload = os.urandom(17 * 1024 * 1024)  # > 16 MiB: three parts of 5 MiB and a tail
    client.put_object(s3_bucket.bucket, "ckpt/shard-0", io.BytesIO(payload), len(payload), part_size=5 << 20)
    stat = client.stat_object(s3_bucket.bucket, "ckpt/shard-0")
    assert stat.size == len(payload)
    assert stat.etag is not None and "-" in stat.etag  # a multipart upload's etag: <md5>-<parts>
    response = client.get_object(s3_bucket.bucket, "ckpt/shard-0")
    try:
        assert response.read() == payload
    finally:
        response.close()
        response.release_conn()


def test_s3_unknown_or_wrong_credentials_rejected(s3_bucket: S3Bucket, embedded_s3: S3Endpoint) -> None:
    if isinstance(embedded_s3, S3Endpoint) and os.environ.get("TRAINYARD_TEST_S3_ENDPOINT"):
        pytest.skip("credentials of an external S3 server are its own business")
    good = _client(s3_bucket.endpoint, s3_bucket.access_key, s3_bucket.secret_key)
    good.put_object(s3_bucket.bucket, "secret", io.BytesIO(b"x"), 1)
    for access_key, secret_key, code in [
        (s3_bucket.access_key, "not-the-secret", "SignatureDoesNotMatch"),
        ("nobody", "whatever-secret", "InvalidAccessKeyId"),
    ]:
        with pytest.raises(S3Error) as err:
            _client(s3_bucket.endpoint, access_key, secret_key).get_object(s3_bucket.bucket, "secret")
        assert err.value.code == code
    anonymous = Minio(s3_bucket.endpoint, secure=False)
    with pytest.raises(S3Error) as err:
        anonymous.put_object(s3_bucket.bucket, "anon", io.BytesIO(b"x"), 1)
    assert err.value.code == "AccessDenied"


def test_two_s3_servers_at_once_and_stop_leaves_nothing(tmp_path: Path) -> None:
    first = EmbeddedS3(tmp_path / "a", access_key="first", secret_key="first-secret-123", bucket="one")
    try:
        second = EmbeddedS3(tmp_path / "b", access_key="second", secret_key="second-secret-123", bucket="two")
        try:
            assert first.endpoint != second.endpoint
            assert not set(first.ports.values()) & set(second.ports.values())
            first.client().put_object("one", "k", io.BytesIO(b"1"), 1)
            second.client().put_object("two", "k", io.BytesIO(b"2"), 1)
            assert first.client().get_object("one", "k").read() == b"1"
            assert second.client().get_object("two", "k").read() == b"2"
            # Each server knows only its own credentials.
            with pytest.raises(S3Error):
                _client(second.endpoint, "first", "first-secret-123").bucket_exists("two")
            listening = _listening_ports(first)
            assert listening, "weed listens on nothing?"
            assert listening <= set(first.ports.values()), f"unexpected ports: {listening - set(first.ports.values())}"
            assert all(addr == "127.0.0.1" for addr in _listening_addresses(first))
        finally:
            second_pid = second.process.pid if second.process else None
            second.stop()
        first_pid = first.process.pid if first.process else None
        first_ports = dict(first.ports)
    finally:
        first.stop()
    for pid in (first_pid, second_pid):
        assert pid is not None and pid_gone(pid)
    assert all(port_is_free(p) for p in first_ports.values())
    leftover = list(Path(os.environ.get("TMPDIR", "/tmp")).glob(f"seaweedfs-*-{first_ports['s3.port']}.sock"))
    assert not leftover
    first.stop()  # idempotent


def test_s3_restart_keeps_data_and_endpoint(tmp_path: Path) -> None:
    with EmbeddedS3(tmp_path, access_key="k", secret_key="restart-secret") as s3:
        s3.client().put_object(s3.bucket, "kept", io.BytesIO(b"data"), 4)
        endpoint = s3.endpoint
    with EmbeddedS3(tmp_path, access_key="k2", secret_key="another-secret") as s3:
        assert s3.endpoint == endpoint  # ports of the last run are reused while free
        assert s3.client().get_object(s3.bucket, "kept").read() == b"data"
        with pytest.raises(S3Error):  # the old key is gone
            _client(s3.endpoint, "k", "restart-secret").bucket_exists(s3.bucket)


def test_s3_explicit_port_in_use_is_an_error(tmp_path: Path) -> None:
    import socket

    from trainyard.embedded import EmbeddedError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        with pytest.raises(EmbeddedError, match="already in use"):
            EmbeddedS3(tmp_path, port=sock.getsockname()[1])


def _listening(server: EmbeddedS3) -> list[tuple[str, int]]:
    assert server.process is not None
    conns = psutil.Process(server.process.pid).net_connections(kind="inet")
    return [(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]


def _listening_ports(server: EmbeddedS3) -> set[int]:
    return {port for _, port in _listening(server)}


def _listening_addresses(server: EmbeddedS3) -> set[str]:
    return {ip for ip, _ in _listening(server)}


# -- helpers and CLI entry point --------------------------------------------------------------------


def test_process_reaper_kills_the_whole_group(process_reaper: ProcessReaper) -> None:
    # A parent that ignores TERM and a grandchild (which inherits the ignored TERM): both must die.
    # The orphaned grandchild dies a moment after the group's KILL, so its end is waited for.
    script = (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print('up', flush=True); time.sleep(60)"
    )
    proc = process_reaper.spawn([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    group = wait_for(lambda: psutil.Process(proc.pid).children(), what="grandchild")
    process_reaper.grace_s = 0.5
    process_reaper.reap()
    assert proc.returncode is not None
    wait_for(lambda: all(pid_gone(p.pid) for p in group), timeout=5, what="grandchild killed")


def test_free_port_is_bindable() -> None:
    port = free_port()
    assert port_is_free(port)


def test_cli_help_is_fast_and_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trainyard", "--help"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for command in ("server", "migrate", "agent", "dev"):
        assert command in out
    dev = subprocess.run(
        [sys.executable, "-m", "trainyard", "dev", "up", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "--gpus-per-node" in dev


def test_cli_bad_input_is_one_line_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainyard", "dev", "up", "--nodes", "zero"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "trainyard", "agent", "--control-plane", "ftp://x",
         "--name", "n", "--address", "127.0.0.1", "--label", "no-equals-sign"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    # A join token is never a command-line argument (issue 11, finding 2): a file or the environment.
    result = subprocess.run(
        [sys.executable, "-m", "trainyard", "agent", "--control-plane", "http://x", "--join-token", "secret",
         "--name", "n", "--address", "127.0.0.1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0 and "--join-token" in result.stderr and "Traceback" not in result.stderr


def test_embedded_postgres_trusts_nobody(embedded_pg: PostgresAdmin) -> None:
    """pgserver initialises with trust authentication; the embedded server replaces it with peer
    authentication for its own OS user only (issue 11, finding 13)."""
    if not isinstance(embedded_pg, EmbeddedPostgres):
        return  # an external server's authentication is its operator's
    from sqlalchemy import create_engine, text

    engine = create_engine(embedded_pg.admin_url)
    try:
        with engine.connect() as conn:
            rules = conn.execute(text("SELECT type, auth_method, error FROM pg_hba_file_rules")).all()
            mapped = conn.execute(text("SELECT system_user FROM pg_ident_file_mappings")).scalars().all()
    finally:
        engine.dispose()
    assert rules and all(method == "peer" and error is None for _, method, error in rules), rules
    assert "nobody" not in mapped and mapped
