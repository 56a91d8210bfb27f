"""The numbers a request may carry, read from an OpenAPI document (issue 28): every integer or number
in an operation's parameters and JSON body, with the schema that bounds it and its description."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NumericField:
    method: str
    path: str
    field: str
    """Where in the request: '?limit' for a query parameter, 'body.model.hidden' in the body."""
    schema: dict[str, Any]
    description: str

    @property
    def bounded(self) -> bool:
        s = self.schema
        return ("minimum" in s or "exclusiveMinimum" in s) and ("maximum" in s or "exclusiveMaximum" in s)


def numeric_fields(doc: dict[str, Any]) -> list[NumericField]:
    found: list[NumericField] = []
    for path, item in doc.get("paths", {}).items():
        for method, operation in item.items():
            numbers: list[tuple[str, dict[str, Any], str]] = []
            for parameter in operation.get("parameters", []):
                _walk(doc, parameter.get("schema", {}), f"?{parameter['name']}",
                      parameter.get("description", ""), frozenset(), numbers)
            for content in operation.get("requestBody", {}).get("content", {}).values():
                _walk(doc, content.get("schema", {}), "body", "", frozenset(), numbers)
            found += [NumericField(method.upper(), path, *number) for number in numbers]
    return found


def _walk(doc: dict[str, Any], node: dict[str, Any], where: str, description: str, seen: frozenset[str],
          found: list[tuple[str, dict[str, Any], str]]) -> None:
    ref = node.get("$ref")
    if ref is not None:
        if ref in seen:  # a recursive schema: its numbers were found on the first pass
            return
        seen = seen | {ref}
        node = doc["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    description = node.get("description") or description
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key, []):
            _walk(doc, sub, where, description, seen, found)
    if node.get("type") in ("integer", "number"):
        found.append((where, node, description))
    if "items" in node:
        _walk(doc, node["items"], f"{where}[]", description, seen, found)
    for name, sub in node.get("properties", {}).items():
        _walk(doc, sub, f"{where}.{name}", sub.get("description", ""), seen, found)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        _walk(doc, extra, f"{where}.*", description, seen, found)
