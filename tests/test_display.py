"""One duration format for the CLI and the dashboard."""

from __future__ import annotations

import pytest

from control_plane.api import ui
from trainyard import job_view
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
