"""Domain errors and their RFC 9457 problem+json rendering.

Services raise these; one handler per class maps it to its HTTP status. The class docstring is
the default human-readable title.
"""

from __future__ import annotations

from typing import Any, ClassVar

PROBLEM_JSON = "application/problem+json"


class TrainyardError(Exception):
    """Something went wrong."""

    status: ClassVar[int] = 500
    slug: ClassVar[str] = "internal"

    def __init__(self, detail: str | None = None, **extra: Any) -> None:
        self.detail = detail or (self.__doc__ or "").strip()
        self.extra = extra
        super().__init__(self.detail)

    @classmethod
    def title(cls) -> str:
        return (cls.__doc__ or cls.__name__).strip().splitlines()[0]

    def problem(self, instance: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": f"https://trainyard.dev/problems/{self.slug}",
            "title": self.title(),
            "status": self.status,
            "detail": self.detail,
        }
        if instance:
            body["instance"] = instance
        body.update(self.extra)
        return body


class NotFound(TrainyardError):
    """The resource does not exist."""

    status = 404
    slug = "not-found"


class Conflict(TrainyardError):
    """The request conflicts with the current state."""

    status = 409
    slug = "conflict"


class InvalidState(Conflict):
    """The resource is not in a state that allows this."""

    slug = "invalid-state"


class StaleAttempt(Conflict):
    """The message comes from an attempt that is not the job's current one."""

    slug = "stale-attempt"


class StaleAgent(Conflict):
    """Another agent instance registered as this node."""

    slug = "stale-agent"


class NodeNameTaken(Conflict):
    """The node name is registered to another agent."""

    slug = "node-name-taken"


class IdempotencyMismatch(Conflict):
    """The Idempotency-Key was used before with a different request body."""

    slug = "idempotency-key-reused"


class Unprocessable(TrainyardError):
    """The request is well-formed but cannot be satisfied."""

    status = 422
    slug = "unprocessable"


class Unauthorized(TrainyardError):
    """Missing or invalid credentials."""

    status = 401
    slug = "unauthorized"


class Forbidden(TrainyardError):
    """The credentials do not allow this."""

    status = 403
    slug = "forbidden"


class TooMany(TrainyardError):
    """Too many requests; retry later."""

    status = 429
    slug = "too-many-requests"

    def __init__(self, detail: str | None = None, *, retry_after_s: float = 1.0, **extra: Any) -> None:
        super().__init__(detail, **extra)
        self.retry_after_s = retry_after_s


class NotReady(TrainyardError):
    """The service is not ready."""

    status = 503
    slug = "not-ready"
