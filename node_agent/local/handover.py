"""Parked parts and the answers their workers get (docs/architecture.md, "In-process restart").

A restartable part told to stop while its workers are all alive is parked: its processes and leases
are kept, and its workers, which left their broken process group, poll their own part's socket
(``POST /v1/local/attempts/<their attempt>/next-assignment`` with their attempt's token) for their
part of the next attempt. This registry answers them:

- ``assigned`` once a launch spec adopting the part arrived and the agent relabelled it: the new
  attempt's id, token, ranks, rendezvous and restore plan, and the socket of its local API;
- ``stop`` once the handover is given up (the handover timeout passed, or the part was stopped):
  the worker raises its error and exits, and the next attempt's part starts cold;
- ``waiting`` otherwise (long-polled for at most the worker's ``wait_s``).

Only a restartable part's own socket ever answers (the local API serves one attempt per socket), and
only to its own token: a worker of any other attempt never learns the new token.
"""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass

from trainyard.protocol.agent import LaunchSpec
from trainyard.protocol.restart import Assignment, NextAssignmentAnswer, Rendezvous


@dataclass
class _Part:
    token: str
    node_rank: int
    nproc: int
    parked_until: float | None = None
    """Monotonic deadline of the handover, once parked."""
    successor: LaunchSpec | None = None
    socket: str | None = None
    stopped: str | None = None
    """Why there is no handover (the worker is told to stop)."""
    claimed: bool = False
    """A takeover is relabelling the part: its deadline and give_up leave it alone until it is
    handed over or released."""


class Handovers:
    """The restartable parts of this agent, by attempt id; thread-safe, long polls wait on a condition."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._parts: dict[str, _Part] = {}

    def register(self, attempt_id: str, token: str, *, node_rank: int, nproc: int) -> None:
        with self._cond:
            self._parts.setdefault(attempt_id, _Part(token, node_rank, nproc))

    def forget(self, attempt_id: str) -> None:
        with self._cond:
            self._parts.pop(attempt_id, None)
            self._cond.notify_all()

    def park(self, attempt_id: str, timeout_s: float) -> bool:
        """Park a registered part for at most ``timeout_s``; False when it is not restartable here."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is None or part.stopped is not None or part.successor is not None:
                return False
            if part.parked_until is None:
                part.parked_until = time.monotonic() + timeout_s
            return True

    def parked(self, attempt_id: str) -> bool:
        with self._cond:
            part = self._parts.get(attempt_id)
            return part is not None and part.parked_until is not None and part.stopped is None \
                and part.successor is None

    def expired(self) -> list[str]:
        """Parked parts whose handover timeout passed (the caller stops them: ``give_up``)."""
        now = time.monotonic()
        with self._cond:
            return [a for a, p in self._parts.items()
                    if p.parked_until is not None and p.successor is None and p.stopped is None
                    and not p.claimed and now >= p.parked_until]

    def shorten(self, attempt_id: str, within_s: float) -> None:
        """Let a parked part wait at most ``within_s`` more (its attempt is stale: the next attempt
        exists, and the spec that takes it over, if any, is on its way)."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is not None and part.parked_until is not None:
                part.parked_until = min(part.parked_until, time.monotonic() + within_s)

    def give_up(self, attempt_id: str, reason: str) -> bool:
        """No handover for the part: its workers are told to stop. False (nothing changed) when a
        takeover claimed it or it was handed over: its workers are the next attempt's now."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is None or part.claimed or part.successor is not None:
                return False
            if part.stopped is None:
                part.stopped = reason
                self._cond.notify_all()
            return True

    def claim(self, attempt_id: str) -> bool:
        """Reserve a parked part for the takeover about to relabel it (atomically against give_up and
        the deadline); False when it is not parked, given up, or claimed already."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is None or part.parked_until is None or part.stopped is not None or part.successor is not None \
                    or part.claimed:
                return False
            part.claimed = True
            return True

    def release(self, attempt_id: str) -> None:
        """The claimed takeover did not happen: the part is parked as before (its deadline counts again)."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is not None:
                part.claimed = False

    def hand_over(self, attempt_id: str, successor: LaunchSpec, socket: str | None) -> bool:
        """The part's workers are now ``successor``'s; False (nothing changed) unless it is parked."""
        with self._cond:
            part = self._parts.get(attempt_id)
            if part is None or part.parked_until is None or part.stopped is not None or part.successor is not None:
                return False
            part.successor, part.socket, part.claimed = successor, socket, False
            self._cond.notify_all()
            return True

    def answer(self, attempt_id: str, token: str, rank: int, wait_s: float) -> NextAssignmentAnswer | None:
        """The answer to a worker's poll; None when ``token`` is not this part's (refuse it: 409)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while True:
                part = self._parts.get(attempt_id)
                if part is None or not _same(token, part.token):
                    return None
                if part.stopped is not None:
                    return NextAssignmentAnswer(state="stop", reason=part.stopped)
                if part.successor is not None:
                    return NextAssignmentAnswer(state="assigned",
                                                assignment=_assignment(part, part.successor, rank))
                left = deadline - time.monotonic()
                if left <= 0:
                    return NextAssignmentAnswer(state="waiting")
                self._cond.wait(left)


def _assignment(part: _Part, spec: LaunchSpec, rank: int) -> Assignment:
    """Worker ``rank`` of the parked part as a rank of ``spec``: the same local rank (its GPU), on the
    node rank the new attempt gives this node."""
    local = rank - part.node_rank * part.nproc
    if not 0 <= local < spec.nproc_per_node:
        raise ValueError(f"rank {rank} is not one of this part's ranks")
    return Assignment(
        attempt_id=spec.attempt_id, attempt_number=spec.attempt_number, fencing_token=spec.fencing_token,
        rank=spec.node_rank * spec.nproc_per_node + local, world_size=spec.nnodes * spec.nproc_per_node,
        node_rank=spec.node_rank, rendezvous=Rendezvous(host=spec.rdzv_host, port=spec.rdzv_port),
        restore_from=spec.restore_from.model_dump(mode="json") if spec.restore_from else None,
        agent_socket=part.socket,
    )


def _same(a: str, b: str) -> bool:
    # A JSON string may hold a lone surrogate: it must compare unequal, not raise.
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))
