"""Keyset pagination's cursors: opaque to clients (url-safe base64 of a JSON list), checked when
read back (422 for one this API did not hand out)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable
from typing import Any

from control_plane.errors import Unprocessable


def encode(*values: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(values), default=str).encode()).decode()


def int64(value: Any) -> int:
    """A converter for ``decode``: a non-negative 64-bit position (an event id)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
        raise ValueError("not a position")
    return value


def decode(cursor: str, *types: type | Callable[[Any], Any]) -> list[Any]:
    """The cursor's values, each converted by its type (int, str, uuid.UUID, datetime.fromisoformat)
    or converter (``int64``)."""
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        if not isinstance(values, list) or len(values) != len(types):
            raise ValueError("wrong shape")
        return [_convert(t, v) for t, v in zip(types, values, strict=True)]
    except (ValueError, TypeError, binascii.Error, UnicodeError) as exc:
        raise Unprocessable("cursor is not one this API returned", field="cursor") from exc


def _convert(kind: type | Callable[[Any], Any], value: Any) -> Any:
    if kind is int:
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
            raise ValueError("not a position")
        return value
    if hasattr(kind, "fromisoformat"):
        return kind.fromisoformat(value)  # type: ignore[attr-defined]
    return kind(value)
