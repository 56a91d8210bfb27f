"""Fixtures for worker_runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.worker_runtime.fake_agent import FakeAgent, serve_fake_agent


@pytest.fixture
def fake_agent() -> Iterator[FakeAgent]:
    with serve_fake_agent() as agent:
        yield agent
