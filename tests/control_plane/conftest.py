from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from control_plane.app import create_app
from control_plane.clock import use_clock
from control_plane.settings import Settings
from tests.factories import ADMIN_TOKEN, JOIN_TOKEN


@pytest.fixture
def settings(fresh_database_url: str) -> Settings:
    return Settings(
        database_url=fresh_database_url,
        admin_token=ADMIN_TOKEN,
        join_token=JOIN_TOKEN,
        run_loops=False,  # tests drive scheduling passes explicitly
        log_json=False,
        startup_grace_s=0,
        node_lost_timeout_s=2,
    )


@pytest.fixture
def app(settings: Settings) -> FastAPI:
    return create_app(settings)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def schedule(app: FastAPI):
    """Run one scheduling pass; returns how many gangs it admitted."""
    return app.state.loops.schedule_once


class Clock:
    """The control plane's clock, moved by hand (control_plane.clock.use_clock)."""

    def __init__(self) -> None:
        self.t = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> Iterator[Clock]:
    c = Clock()
    use_clock(c)
    try:
        yield c
    finally:
        use_clock(None)
