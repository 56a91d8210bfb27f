"""The planner's one error: inputs that cannot be planned, with the numbers that say why."""

from __future__ import annotations

from typing import Any


class PlanningError(ValueError):
    """The inputs cannot be planned (contradictory, incomplete, or nothing fits)."""

    def __init__(self, message: str, *, field: str | None = None, **numbers: Any) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.numbers = numbers
