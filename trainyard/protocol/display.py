"""How durations read to a person: one format for the CLI (trainyard/job_view.py) and the dashboard
(control_plane/api/ui.py), so that a job's age or ETA reads the same in both."""

from __future__ import annotations


def duration(seconds: float | None) -> str:
    """3s, 4m05s, 2h03m, 3d04h: short and sortable by eye; "-" for none."""
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
