"""RFC 9457 problem documents: the body of every error answer (``application/problem+json``).

The OpenAPI document declares them for every error status (control_plane/openapi.py), so a
generated client parses an error instead of failing on an undeclared body."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class FieldError(BaseModel):
    field: str = Field(description="Dotted path of the invalid field ('' for the body itself).")
    message: str
    type: str = Field(description="Machine-readable kind, e.g. 'missing', 'json_invalid'.")
    line: int | None = Field(default=None, description="For a body that is not JSON: the line of the error.")
    column: int | None = Field(default=None, description="For a body that is not JSON: the column of the error.")


class Problem(BaseModel):
    """An error: ``type`` names the kind, ``detail`` says what went wrong in this request. Some
    kinds carry more members (``errors`` for validation, the planner's numbers for a refused job)."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="URI of the problem kind, e.g. https://trainyard.dev/problems/not-found.")
    title: str
    status: int
    detail: str
    instance: str | None = Field(default=None, description="The request path.")
    errors: list[FieldError] | None = Field(default=None, description="Each invalid field (422).")
