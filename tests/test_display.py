"""One duration format for the CLI and the dashboard."""

from __future__ import annotations

import pytest

from control_plane.api import ui
from trainyard.cli import job_view
from trainyard.protocol.display import duration


@pytest.mark.parametrize(("seconds", "shown"), [(None, "-"), (-5, "0s"), (59.9, "59s"), (245, "4m05s"),
                                                (7380, "2h03m"), (273_600, "3d04h")])
def test_durations_read_the_same_in_the_cli_and_the_dashboard(seconds: float | None, shown: str) -> None:
    assert duration(seconds) == shown
    assert job_view.duration(seconds) == shown
    assert ui.templates.env.filters["duration"](seconds) == shown


def test_the_job_view_says_whether_the_memory_tier_is_on() -> None:
    assert job_view.checkpoint_line({"interval_steps": 50, "keep_last": 3, "memory_tier": True}) == (
        "every 50 steps, keep 3, memory tier on")
    assert job_view.checkpoint_line({"interval_steps": "auto", "keep_last": 2, "memory_tier": False}) == (
        "auto interval, keep 2, memory tier off (restores read S3)")
    assert job_view.checkpoint_line({"keep_last": 3}) is None  # no checkpoints at all


def test_text_from_a_job_cannot_drive_a_terminal() -> None:
    """A job's log line or error reaches the CLI and the dashboard with every control character a
    terminal acts on written out: no color, no cleared screen, no new window title, no bidi override."""
    from trainyard.protocol.display import printable, printable_data

    hostile = "\x1b]0;owned\x07\x1b[2J\x9b31m\u202eexe.txt\x7f\r"
    shown = printable(hostile)
    assert all(ord(c) >= 0x20 and not 0x7F <= ord(c) < 0xA0 and c != "\u202e" for c in shown), shown
    assert shown == "\\x1b]0;owned\\x07\\x1b[2J\\x9b31m\\u202eexe.txt\\x7f\\x0d"
    assert printable("tabs\tand\nnewlines stay, é and 中 too") == "tabs\tand\nnewlines stay, é and 中 too"
    data = printable_data({"end_reason": "boom\x1b[31m", "metrics": {"l\x1bss": [1.0, "x\x07"]}, "step": 3})
    assert data == {"end_reason": "boom\\x1b[31m", "metrics": {"l\\x1bss": [1.0, "x\\x07"]}, "step": 3}
    table = job_view.describe({"id": "j" * 36, "name": "n", "state": "failed", "tenant": "t", "priority": 0,
                               "entrypoint": "e", "args": [], "progress": {}, "end_reason": "x\x1b[2Jy",
                               "num_nodes": 1, "gpus_per_node": 1, "failures": 1, "max_failures": 0,
                               "created_at": "2026-12-06T00:00:00+00:00"}, [], [], [])
    from io import StringIO

    from rich.console import Console

    out = StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    assert "\x1b" not in out.getvalue() and "x\\x1b[2Jy" in out.getvalue()
