"""Fixtures shared by the whole suite: real PostgreSQL and S3 servers, fresh databases and buckets.

The servers are started once per session (``trainyard.embedded``), or taken from the environment:

- ``TRAINYARD_TEST_DATABASE_URL``: superuser URL of an existing PostgreSQL server (any database;
  the fixtures create and drop their own databases on it).
- ``TRAINYARD_TEST_S3_ENDPOINT`` (host:port), ``TRAINYARD_TEST_S3_ACCESS_KEY``,
  ``TRAINYARD_TEST_S3_SECRET_KEY``: an existing S3 server.

The schema is built once per session (Alembic, ``control_plane.db.run_migrations``) into a template
database; every test that asks for ``fresh_database_url`` gets its own copy of it (a file copy
inside PostgreSQL, ~0.1 s) and it is dropped afterwards.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers import ProcessReaper
from trainyard.embedded import EmbeddedPostgres, EmbeddedS3, PostgresAdmin, S3Endpoint

# Agents the suite starts keep no warm standbys unless a test is marked ``standbys`` (or asks with
# ``--standbys N``, the e2e cluster's {"standbys": N}): an agent's zygote imports torch once, which a
# test that runs one attempt pays without gaining from it. The tests that recover (several attempts
# per node) run the default, ``auto``: their later attempts fork where they would import.
os.environ.setdefault("TRAINYARD_AGENT_STANDBYS", "0")


# The slowest modules, slowest first (about a minute of wall time or more per test on the 2-core
# development machine; docs/benchmarks.md, "make test").
SLOWEST_FIRST = (
    "tests/e2e/test_guide_and_dashboard.py", "tests/e2e/test_recovery.py", "tests/e2e/test_watchdogs.py",
    "tests/e2e/test_partitions.py", "tests/e2e/test_isolation.py", "tests/e2e/test_fair_scheduling.py",
    "tests/e2e/test_user_resume.py", "tests/e2e/test_node_faults.py", "tests/e2e/test_command_jobs.py",
    "tests/e2e/test_checkpoint_faults.py", "tests/e2e/test_standby.py", "tests/e2e/test_faults.py",
)


# `make test` runs two pytest sessions at once (scripts/test-lanes.sh): the "heavy" lane on the
# xdist workers, and the "light" lane in one process at a lower CPU priority, which takes the cores
# only while the heavy lane's tests wait on their processes. A module is light when it is outside
# tests/e2e and its source starts no process, thread or wait of its own (HEAVY_SOURCE): a test that
# waits on time or on another process must not run at the low priority. Anything else is heavy, so
# a new test module is heavy until it reads as light. TRAINYARD_TEST_LANE unset: every module.
TEST_LANE = os.environ.get("TRAINYARD_TEST_LANE", "")
HEAVY_SOURCE = re.compile(
    r"make_cluster|live_cluster|run_torchrun|torchrun|subprocess|Popen|ProcessReaper|multiprocessing|"
    r"threading|Thread|os\.fork|spawn|start_agent|dev_cluster|AgentProcess|uvicorn|trainyard server|"
    r"time\.sleep|wait_for|EmbeddedS3|proxy")
TESTS = Path(__file__).resolve().parent


def lane_of(path: Path) -> str:
    """``light`` or ``heavy``: where a test module runs when the suite runs in lanes."""
    relative = path.resolve().relative_to(TESTS)
    if relative.parts[0] == "e2e":
        return "heavy"
    return "heavy" if HEAVY_SOURCE.search(path.read_text(encoding="utf-8")) else "light"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if TEST_LANE not in ("light", "heavy") or collection_path.suffix != ".py" \
            or not collection_path.name.startswith("test_"):
        return None
    return True if lane_of(collection_path) != TEST_LANE else None

# Outside tests/e2e, modules with a test of 10 s or more: dealt with the torchrun tests, before the
# short ones, so that none of them is what a worker still runs when the other has run dry.
SLOW_UNITS = (
    "tests/control_plane/test_lock_order.py", "tests/test_bench_start_limits.py",
    "tests/control_plane/test_checkpoint_scale.py", "tests/test_bench_gpu_fast_path.py",
    "tests/node_agent/test_launcher.py", "tests/control_plane/test_liveness_lane.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the order, never what runs: the longest tests first. pytest-xdist's worksteal gives each
    worker a contiguous share of the collection and, when one runs dry, moves the end of another's
    share to it; so each share is dealt longest first (end-to-end tests, then the torchrun ones,
    then the rest), and what is left to move or to finish last is short: no worker waits idle
    while the other runs a two-minute test at the end."""
    def cost(item: pytest.Item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if path in SLOWEST_FIRST:
            return 0, SLOWEST_FIRST.index(path)
        if item.get_closest_marker("e2e") is not None:
            return 1, 0
        return (2, 0) if path.startswith("tests/worker_runtime/") or path in SLOW_UNITS else (3, 0)
    ordered = sorted(items, key=cost)  # stable: the collection's order within a kind
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = [item for share in range(workers) for item in ordered[share::workers]]


@pytest.fixture(autouse=True)
def _standbys_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("standbys") is not None:
        monkeypatch.setenv("TRAINYARD_AGENT_STANDBYS", "auto")


@pytest.fixture(scope="session")
def embedded_pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresAdmin]:
    """A PostgreSQL server for the session: an :class:`EmbeddedPostgres` (stopped at the end), or a
    :class:`PostgresAdmin` for ``TRAINYARD_TEST_DATABASE_URL``. Both offer ``admin_url``,
    ``url_for(db)``, ``create_database(name, template=None)`` and ``drop_database(name)``."""
    external = os.environ.get("TRAINYARD_TEST_DATABASE_URL")
    if external:
        yield PostgresAdmin(external)
        return
    base = postgres_base_dir()
    server = EmbeddedPostgres(base / "pgdata")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


def postgres_base_dir() -> Path:
    """A new directory for a PGDATA, outside pytest's temp root. As root, pgserver runs PostgreSQL as
    user ``pgserver`` and opens the parent directories to it (o+rx); but every pytest session that
    starts on the machine resets /tmp/pytest-of-root to 0700, and a server whose data dir lies below
    it then PANICs ("could not stat data directory: Permission denied")."""
    return Path(tempfile.mkdtemp(prefix="trainyard-test-pg-"))


@pytest.fixture(scope="session")
def embedded_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """An S3 server for the session, as an :class:`S3Endpoint` (``endpoint``, ``access_key``,
    ``secret_key``, ``bucket``, ``client()``): a ``weed mini`` started here and stopped at the end,
    or the server named by ``TRAINYARD_TEST_S3_*``."""
    endpoint = os.environ.get("TRAINYARD_TEST_S3_ENDPOINT")
    if endpoint:
        yield S3Endpoint(
            endpoint=endpoint,
            access_key=os.environ.get("TRAINYARD_TEST_S3_ACCESS_KEY", ""),
            secret_key=os.environ.get("TRAINYARD_TEST_S3_SECRET_KEY", ""),
        )
        return
    server = EmbeddedS3(
        tmp_path_factory.mktemp("s3"), access_key="trainyard-test", secret_key=secrets.token_urlsafe(24)
    )
    try:
        yield server.info
    finally:
        server.stop()


class _Template:
    """The migrated template database, built the first time a test asks for a fresh database."""

    def __init__(self, pg: PostgresAdmin) -> None:
        self.pg = pg
        self.name: str | None = None

    def get(self) -> str:
        if self.name is None:
            # Imported here so that a missing or broken control_plane.db errors the tests that need
            # a schema (with the import error) rather than being skipped or breaking collection.
            from control_plane.db import run_migrations

            name = f"trainyard_template_{secrets.token_hex(4)}"
            self.pg.create_database(name)
            try:
                run_migrations(self.pg.url_for(name))
                self.pg.mark_template(name)
            except BaseException:
                self.pg.drop_database(name)
                raise
            self.name = name
        return self.name


@pytest.fixture(scope="session")
def _schema_template(embedded_pg: PostgresAdmin) -> Iterator[_Template]:
    template = _Template(embedded_pg)
    yield template
    if template.name is not None:
        embedded_pg.drop_database(template.name)


@pytest.fixture
def fresh_database_url(embedded_pg: PostgresAdmin, _schema_template: _Template) -> Iterator[str]:
    """SQLAlchemy URL (psycopg 3) of a new database with the schema at Alembic head; dropped after."""
    _check_alive(embedded_pg)
    template = _schema_template.get()
    name = f"trainyard_test_{secrets.token_hex(6)}"
    url = embedded_pg.create_database(name, template=template)
    try:
        yield url
    finally:
        embedded_pg.drop_database(name)


def _check_alive(pg: PostgresAdmin) -> None:
    """Fail with the server's log, not with a connection error, when the session server died."""
    if isinstance(pg, EmbeddedPostgres) and not pg.is_running():
        log = pg.data_dir / "log"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.exists() else []
        pytest.fail(f"the session's PostgreSQL ({pg.data_dir}) is no longer running; log tail:\n" + "\n".join(tail))


class S3Bucket(NamedTuple):
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str


@pytest.fixture
def s3_bucket(embedded_s3: S3Endpoint) -> Iterator[S3Bucket]:
    """A new, empty bucket on the session's S3 server: (endpoint, access_key, secret_key, bucket).
    Emptied and removed afterwards."""
    from minio.deleteobjects import DeleteObject

    client = embedded_s3.client()
    bucket = f"test-{secrets.token_hex(6)}"
    client.make_bucket(bucket)
    try:
        yield S3Bucket(embedded_s3.endpoint, embedded_s3.access_key, embedded_s3.secret_key, bucket)
    finally:
        objects = [DeleteObject(o.object_name) for o in client.list_objects(bucket, recursive=True) if o.object_name]
        errors = list(client.remove_objects(bucket, objects)) if objects else []
        try:
            client.remove_bucket(bucket)
        except Exception as exc:  # a leftover bucket costs nothing but space: warn, don't fail
            warnings.warn(f"could not remove test bucket {bucket}: {exc} {errors}", stacklevel=1)


@pytest.fixture
def process_reaper() -> Iterator[ProcessReaper]:
    """Records subprocesses (``spawn(args, **popen_kwargs)`` or ``add(popen)``); at teardown their
    process groups get SIGTERM, then SIGKILL after a grace period."""
    reaper = ProcessReaper()
    try:
        yield reaper
    finally:
        reaper.reap()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
