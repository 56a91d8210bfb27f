"""Engine, sessions and migrations.

Request handlers get a session from ``get_session`` (one transaction per request, committed by the
service that mutates). Background loops use ``session_scope``. Network calls never happen while a
session holds a transaction open (STYLE: claim, release, call, apply).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from sqlalchemy import CursorResult, Engine, ScalarResult, Select, create_engine, event, text
from sqlalchemy.orm import Session, SessionTransaction, sessionmaker

T = TypeVar("T")

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def rowcount(result: Any) -> int:
    """Rows a DML statement matched (``Result`` is a ``CursorResult`` for INSERT/UPDATE/DELETE)."""
    return int(cast(CursorResult[Any], result).rowcount or 0)


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 20, pool_timeout_s: float = 30.0) -> Engine:
    """``pool_size + max_overflow`` must cover every thread that may hold a connection at once
    (create_app sizes it from the request threads and the loops); ``pool_timeout_s`` is how long a
    thread waits for one before the request is answered 503 (app.py)."""
    return create_engine(
        url,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_timeout_s,
        pool_pre_ping=True,
        pool_recycle=300,
    )


def _mark_wrote(session: Session, _flush_context: object) -> None:
    session.info["wrote"] = True


def _transaction_ended(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:
        session.info.pop("wrote", None)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions that remember whether their transaction flushed writes (``info["wrote"]``): the
    API ends a request's read-only transaction by committing it (api/deps.py, end_transaction)."""
    factory = sessionmaker(engine, expire_on_commit=False, autoflush=True)
    event.listen(factory, "after_flush", _mark_wrote)
    event.listen(factory, "after_transaction_end", _transaction_ended)
    return factory


@functools.cache
def code_schema_version() -> str:
    """The revision this code's migrations end at: the schema its models describe."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("postgresql://unused")).get_current_head()
    if head is None:
        raise RuntimeError(f"no migration in {MIGRATIONS_DIR}")
    return str(head)


def schema_problem(engine: Engine) -> str | None:
    """Why this replica must not serve (None: it may): the database is not migrated, or to another
    revision than this code's. A replica of the previous release after a migration, or a new one
    before it, reads tables by names that may not be there (a rename): its ``/readyz`` says so, and
    the load balancer sends it nothing (raises if the database cannot be reached)."""
    version, expected = schema_version(engine), code_schema_version()
    if not version:
        return "database schema is not migrated; run 'trainyard migrate'"
    if version != expected:
        return (f"database schema is at revision {version}, this control plane's code needs {expected}: run "
                f"'trainyard migrate' with this release, or replace this replica with the release that migrated it")
    return None


def schema_version(engine: Engine) -> str | None:
    """The migrated schema's Alembic revision (raises if the database cannot be reached)."""
    with engine.connect() as conn:
        version = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return str(version) if version else None


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose transaction commits on success and rolls back on error."""
    session = factory()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def reload(session: Session, stmt: Select[T]) -> ScalarResult[T]:
    """Run an ORM SELECT whose rows replace what the session holds of them (``populate_existing``),
    after flushing the session's pending changes: a reload would otherwise overwrite them, and a
    caller inside ``Session.no_autoflush`` would silently lose its writes."""
    session.flush()
    return session.scalars(stmt.execution_options(populate_existing=True))


def alembic_config(database_url: str):  # type: ignore[no-untyped-def]
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def run_migrations(database_url: str, revision: str = "head") -> None:
    """Bring the database schema to ``revision`` with Alembic."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)
