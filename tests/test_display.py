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
