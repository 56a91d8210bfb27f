"""Per-principal caps on things held at once on one replica (followed logs, code uploads in flight):
one counter per principal under a lock, refused with 429 and Retry-After past the cap."""

from __future__ import annotations

import threading

from control_plane.errors import TooMany


class PrincipalGate:
    """At most ``per_principal`` held at once per principal; ``what`` and ``setting`` name them in the
    refusal (``"code uploads in flight"``, ``"code_uploads_per_principal"``)."""

    def __init__(self, per_principal: int, *, what: str, setting: str, advice: str) -> None:
        self.per_principal = per_principal
        self.what, self.setting, self.advice = what, setting, advice
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, principal: str) -> None:
        with self._lock:
            held = self._held.get(principal, 0)
            if held >= self.per_principal:
                raise TooMany(f"principal {principal} already has {held} {self.what} on this replica "
                              f"({self.setting}); {self.advice}", retry_after_s=5)
            self._held[principal] = held + 1

    def release(self, principal: str) -> None:
        with self._lock:
            held = self._held.get(principal, 0) - 1
            if held > 0:
                self._held[principal] = held
            else:
                self._held.pop(principal, None)

    def held(self, principal: str) -> int:
        with self._lock:
            return self._held.get(principal, 0)
