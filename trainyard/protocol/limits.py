"""Limits of every value that crosses a boundary into the control plane (standard library and
pydantic only): what PostgreSQL columns hold, and what no honest sender exceeds.

A value outside them is refused where it enters (422 from the control plane's API, from the
agent's local API to a worker), never stored: PostgreSQL refuses NUL characters in text and JSONB
and integers past a column's range, and those refusals were 500s.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field

INT32_MAX = 2**31 - 1
"""The largest value of an ``Integer`` column (steps, ranks, pids, exit codes, attempt numbers)."""
INT64_MAX = 2**63 - 1
"""The largest value of a ``BigInteger`` column (event ids, log offsets, sizes, heartbeat seq)."""
TEXT_LINE = r"^[^\x00-\x1f\x7f]*$"
"""A single line of text: no control characters (NUL, newlines)."""

MAX_DATA_BYTES = 16 * 1024
"""The largest JSON document a worker may attach to an event, or report as a job's result."""
MAX_DATA_DEPTH = 16
MAX_MESSAGE_CHARS = 4096
MAX_METRICS = 64


def no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


def _walk(value: Any, depth: int) -> None:
    if depth > MAX_DATA_DEPTH:
        raise ValueError(f"is nested deeper than {MAX_DATA_DEPTH} levels")
    if isinstance(value, str):
        no_nul(value)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError("must not contain NaN or infinite numbers")
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if abs(value) > INT64_MAX:
            raise ValueError("has an integer outside the 64-bit range")
    elif isinstance(value, dict):
        for key, item in value.items():
            no_nul(str(key))
            _walk(item, depth + 1)
    elif isinstance(value, list | tuple):
        for item in value:
            _walk(item, depth + 1)


def json_document(value: dict[str, Any]) -> dict[str, Any]:
    """A JSON object PostgreSQL's JSONB stores: no NUL in any string or key, finite numbers, at most
    MAX_DATA_BYTES encoded and MAX_DATA_DEPTH levels deep."""
    _walk(value, 0)
    size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())
    if size > MAX_DATA_BYTES:
        raise ValueError(f"is {size} bytes as JSON; at most {MAX_DATA_BYTES} are allowed")
    return value


def finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise ValueError("must be a finite number")
    return value


Text = Annotated[str, AfterValidator(no_nul)]
"""Any text that is stored: no NUL."""
JsonDocument = Annotated[dict[str, Any], AfterValidator(json_document)]
Int32 = Annotated[int, Field(ge=0, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
Finite = Annotated[float, AfterValidator(finite)]
