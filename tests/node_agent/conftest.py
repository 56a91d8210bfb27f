"""Fixtures for the node agent tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.node_agent.helpers import Launcher


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    try:
        yield launcher
    finally:
        launcher.cleanup()


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory a worker uid can reach (a pytest tmp_path is 0700): wheels, code, worker dirs."""
    base = Path(tempfile.mkdtemp(prefix="trainyard-open-", dir="/tmp"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def keep_logging() -> Iterator[None]:
    """The agent's command line configures structlog for the process (its level, printing to the
    stderr of the moment: a capture that pytest closes later); put the configuration back after."""
    import structlog

    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)
