"""How durations read to a person: one format for the CLI (trainyard/cli/job_view.py) and the dashboard
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


# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional overrides and isolates
# that reorder what a reader sees (CVE-2021-42574): none has a place in text shown to a person.
_UNSAFE = {*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F),
           *range(0x2066, 0x206A)}
_ESCAPES = {c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}" for c in _UNSAFE}


def printable(text: str) -> str:
    """``text`` with every control character a terminal or a browser would act on written out as a
    visible escape (``\\x1b``): a job's log line, error or name can color, move, clear or retitle
    no one's terminal, and cannot hide text behind a bidirectional override. Tabs and newlines stay."""
    return text.translate(_ESCAPES) if any(ord(c) in _UNSAFE for c in text) else text


def printable_data(value: object) -> object:
    """``printable`` applied to every string inside decoded JSON (dict keys included)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_data(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [printable_data(v) for v in value]
    return value
