"""Logging writes to sys.stderr as it is at each line (found when a CLI test's captured output was
closed under a cached logger, and every later log line in the process raised ValueError)."""

from __future__ import annotations

import io
import sys

import structlog

from control_plane.logging import configure_logging


def test_a_cached_logger_follows_sys_stderr_when_it_is_replaced(monkeypatch):
    configure_logging(json=True)
    log = structlog.get_logger("trainyard.test")
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    log.info("one")  # cached now, while stderr is `first`
    first.close()
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("two")
    assert '"event": "two"' in second.getvalue()
