"""What a worker says about the in-memory checkpoint tier, checked before it is recorded (pure)."""

from __future__ import annotations

from typing import Any

TIERS = ("process", "local", "peer", "s3")
MAX_RANKS = 1 << 20


def restored_tiers(data: dict[str, Any]) -> dict[str, list[int]] | None:
    """The ``tiers`` of a ``checkpoint.restored`` worker event (tier -> the ranks it served), or
    None when absent or malformed: it is a fact for the job view, never trusted for a decision."""
    tiers = data.get("tiers")
    if not isinstance(tiers, dict) or not tiers or not set(tiers) <= set(TIERS):
        return None
    out: dict[str, list[int]] = {}
    for tier in TIERS:
        ranks = tiers.get(tier)
        if ranks is None:
            continue
        if not isinstance(ranks, list) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                  and 0 <= r < MAX_RANKS for r in ranks):
            return None
        out[tier] = sorted(set(ranks))
    return out
