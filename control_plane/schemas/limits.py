"""Limits shared by the API's request models: what reaches PostgreSQL must fit its columns.

The agent wire contract has its own in trainyard/protocol/limits.py (the same numbers)."""

from __future__ import annotations

from trainyard.protocol.limits import INT32_MAX, INT64_MAX, TEXT_LINE, no_nul

__all__ = ["INT32_MAX", "INT64_MAX", "TEXT_LINE", "no_nul"]
