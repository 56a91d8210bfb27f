"""When a stopped part may be parked for a handover (docs/architecture.md, "In-process restart of
healthy ranks"): one rule, used where the agent is told to stop (its desired state and the status
answer say ``handover_ok``), where a parked report is accepted (409 otherwise), and where a pass
reads and takes over parked parts.

A handover keeps the part's processes alive as the next attempt's. That is right only for a part
whose node was healthy when its peer's process failed: never for a job that is not coming back
(cancelled, out of time, out of failures, succeeded), never for a hang (the watchdog fails an
attempt whose workers are all alive: they are the hung processes), and never for the node blamed
for the failure.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptPart, Job

HANDOVER_KINDS = ("out_of_memory", "exception", "signal", "exit_code", "node_lost", "launch_error")
"""Failure kinds (trainyard.protocol.exits) that name a process or node that ended: the other nodes'
workers are healthy. Not ``collective_timeout`` (every failed rank timed out in a collective: a hang
somewhere, perhaps in the processes that are still alive), nor what the control plane decides
without an exit (``time_limit``, ``other``: the hang watchdog), nor ``start_error``."""


def refusal(job: Job, attempt: Attempt, part: AttemptPart) -> str | None:
    """Why ``part`` (of ``attempt`` of ``job``) may not be parked, or None when it may."""
    if not job.restartable:
        return f"job {job.id} is not restartable"
    if part.desired != "stop":
        return "it was not told to stop"
    if attempt.outcome != "failed" or job.state != "recovering" or job.current_attempt_id != attempt.id:
        return f"its job is not recovering from this attempt's failure (job {job.state}, attempt {attempt.outcome})"
    if attempt.hung_since is not None:
        return "its attempt hung: its live workers may be the hung processes"
    if attempt.failure_kind not in HANDOVER_KINDS:
        return f"its attempt failed as {attempt.failure_kind}: its live workers may be the cause"
    if attempt.failed_node_id is None or attempt.failed_node_id == part.node_id:
        return "its node is the one blamed for the failure"
    return None


def clauses() -> list[Any]:
    """``refusal`` as SQL conditions over Job, Attempt and AttemptPart (joined by the caller)."""
    return [Job.restartable.is_(True), AttemptPart.desired == "stop", Attempt.outcome == "failed",
            Job.state == "recovering", Job.current_attempt_id == Attempt.id, Attempt.hung_since.is_(None),
            Attempt.failure_kind.in_(HANDOVER_KINDS), Attempt.failed_node_id.is_not(None),
            AttemptPart.node_id != Attempt.failed_node_id]


def parks_nothing() -> list[Any]:
    """SQL conditions over Job and Attempt (joined by the caller), any of which means that no part of
    the attempt may be parked (``refusal`` refuses every node's for a reason of the attempt's, not
    of the part's): the next attempt may then have the GPUs of its stopping parts at once
    (services/runs/handover.py, passing). A job that parks waits for its parts to be parked or
    stopped, so that a pass never starts cold what could have been handed over."""
    return [Job.restartable.is_(False), Attempt.hung_since.is_not(None), Attempt.failure_kind.is_(None),
            Attempt.failure_kind.not_in(HANDOVER_KINDS), Attempt.failed_node_id.is_(None)]


def parks(job: Job, attempt: Attempt) -> bool:
    """Whether the healthy parts of this failed attempt may be parked (``parks_nothing`` is false)."""
    return bool(job.restartable and attempt.hung_since is None and attempt.failure_kind in HANDOVER_KINDS
                and attempt.failed_node_id is not None)


def handover_ok(session: Session, node_id: uuid.UUID, attempt_ids: Iterable[str | uuid.UUID]) -> set[str]:
    """Of these attempts, those whose part on ``node_id`` its agent may park now (one query)."""
    ids = sorted({i for i in (_uuid(a) for a in attempt_ids) if i is not None})
    if not ids:
        return set()
    return {str(a) for a in session.scalars(
        select(AttemptPart.attempt_id)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .where(AttemptPart.node_id == node_id, AttemptPart.attempt_id.in_(ids),
               AttemptPart.released_at.is_(None), *clauses()))}


def _uuid(value: str | uuid.UUID) -> uuid.UUID | None:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        return None  # an id the agent holds that is no attempt of ours: nothing to park
