"""Attempts: one run of a job on a gang of GPUs, owned by a fencing token, and how it ends.

An attempt is ``starting`` -> ``running`` -> ``stopping`` -> ``ended``. It is created in
allocation.py, and its nodes' status reports are merged and decided in status_reports.py. It is
decided (outcome set, nodes told to stop) in ``end_attempt``; it is over (``ended``) only when every
node has confirmed that its processes are gone and its leases are released. Reports are fenced: only
the job's current attempt, with the right token, can change anything, and merges are monotonic, so
a duplicated or late report never moves a state backwards. See docs/architecture.md.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import and_, exists, func, or_, select, tuple_, update
from sqlalchemy.orm import Session, aliased

from control_plane import wakeups
from control_plane.clock import now
from control_plane.db import reload
from control_plane.models import Attempt, AttemptPart, GpuLease, Job, Node, Worker
from control_plane.services import events
from control_plane.services.locks import attempt_order, lock_attempts, lock_parts
from control_plane.services.runs import parking
from control_plane.services.runs.fencing import lock_attempt
from control_plane.services.states import (
    JOB_TERMINAL,
    NODE_UNREACHABLE,
    PART_UNLAUNCHED,
    advance_part,
    set_attempt_state,
    set_job_state,
)
from trainyard.protocol.exits import message_step


def end_attempt(session: Session, attempt: Attempt, *, outcome: str, reason: str) -> bool:
    """Decide the attempt's outcome once and tell every node to stop. Idempotent."""
    if attempt.outcome is not None:
        return False
    attempt.outcome = outcome
    attempt.end_reason = reason
    if outcome != "succeeded":
        attempt.failed_at = now()
    stopped = session.scalars(
        update(AttemptPart).where(AttemptPart.attempt_id == attempt.id).values(desired="stop")
        .returning(AttemptPart.node_id)
    ).all()
    wakeups.notify_nodes(session, stopped)  # their agents learn of the stop now, not at a heartbeat
    set_attempt_state(session, attempt, "stopping", reason, kind=f"attempt.{outcome}")
    return True


def fail_attempt(
    session: Session, job: Job, attempt: Attempt, reason: str, *, node_id: uuid.UUID | None = None,
    kind: str = "other", message: str | None = None,
) -> None:
    """End a failed attempt, count the failure, and move the job on (recover or fail).

    ``node_id`` is the node blamed for the failure (its worker died first, its torchrun failed, or
    it was lost): a node blamed twice by one job for failures of a node's kind (NODE_FAULT_KINDS)
    is avoided for that job (scheduler/allocate.py). ``kind`` classifies it
    (trainyard.protocol.exits.FAILURE_KINDS); a script that cannot start (``start_error``) fails
    the job at once: another attempt would fail the same way. So does an exception (``message``:
    the failed worker's, naming the step) that the attempt before ended with too, unless the job
    has ``retry_same_exception``.
    """
    if not end_attempt(session, attempt, outcome="failed", reason=reason):
        return
    attempt.failed_node_id = node_id
    attempt.failure_kind = kind
    if job.state in JOB_TERMINAL or job.state == "cancelling":
        return
    job.failures = (job.failures or 0) + 1
    if kind == "start_error":
        set_job_state(session, job, "failed", f"the script cannot start, so it is not retried: {reason}",
                      failure_kind=kind)
        return
    if not job.retry_same_exception and _repeats_the_last_failure(session, attempt, kind, message):
        set_job_state(session, job, "failed",
                      f"attempt {attempt.number} failed with the same exception at the same step as attempt "
                      f"{attempt.number - 1}, so it is not retried (retry_same_exception: true retries it): {reason}",
                      failure_kind=kind)
        return
    if job.failures > job.max_failures:
        chain = [
            f"attempt {a.number}: {a.end_reason}"
            for a in session.scalars(
                select(Attempt).where(Attempt.job_id == job.id).order_by(Attempt.number)
            )
            if a.outcome == "failed"
        ]
        set_job_state(
            session,
            job,
            "failed",
            f"{job.failures} failed attempts exceed max_failures={job.max_failures}: " + "; ".join(chain),
            reasons=chain,
        )
    else:
        set_job_state(
            session,
            job,
            "recovering",
            f"attempt {attempt.number} failed ({reason}); recovery {job.failures} of {job.max_failures}",
        )
        if not parking.parks(job, attempt):  # a job that parks waits for its parts to be parked
            session.info[RECOVERING] = True  # a pass may place its next attempt now (handover.pass_leases)


def _repeats_the_last_failure(session: Session, attempt: Attempt, kind: str, message: str | None) -> bool:
    """The attempt before this one failed with this exception too, at the same step: a third try
    would fail the same way (issue 26). Only a message that names its step (worker_runtime's
    TrainLoop adds it: trainyard.protocol.exits.message_step) is compared: the same exception at
    another step may be the data's or a race's, and is retried."""
    if kind != "exception" or not message or message_step(message) is None:
        return False
    before = session.scalar(select(Attempt.id).where(
        Attempt.job_id == attempt.job_id, Attempt.number == attempt.number - 1, Attempt.failure_kind == "exception"))
    if before is None:
        return False
    same = select(Worker.id).where(Worker.attempt_id == before, Worker.exit_cause == "exception",
                                   Worker.exit_message == message)
    return session.scalar(same.limit(1)) is not None


def fail_unlaunched(session: Session, *, timeout_s: float, batch: int = 500) -> list[uuid.UUID]:
    """Fail every attempt with a part its agent has not confirmed launching ``timeout_s`` after
    allocation (a maintenance step of the monitor loop); returns those attempts.

    A part stays ``assigned`` until its agent reports it: an agent that never picks it up (it was
    assigned on a node being declared lost, or the agent cannot launch it and says nothing) would
    otherwise hold the gang's GPUs for ever. Its leases are released as usual, when its node's
    heartbeat does not list it (or the node is removed). Not a part that waits for the processes of
    the part it follows (lease passing: services/runs/handover.py): its node could not launch it
    yet, as a job waits for a lease without a timeout; a lost node still fails the attempt."""
    cutoff = now() - timedelta(seconds=timeout_s)
    before = aliased(AttemptPart)
    waiting = exists().where(before.id == AttemptPart.follows_part_id, before.released_at.is_(None))
    rows = session.execute(
        select(AttemptPart.attempt_id, AttemptPart.id)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .where(AttemptPart.state.in_(PART_UNLAUNCHED), AttemptPart.released_at.is_(None),
               Attempt.outcome.is_(None), Attempt.created_at < cutoff, ~waiting)
        .order_by(AttemptPart.attempt_id, AttemptPart.node_rank)
        .limit(batch)
    ).all()
    failed: list[uuid.UUID] = []
    for attempt_id, part_id in rows:
        if attempt_id in failed:
            continue
        locked = lock_attempt(session, attempt_id)  # job, then attempt: see lock_attempt
        if locked is None:
            continue
        job, attempt = locked
        part = reload(session, select(AttemptPart).where(AttemptPart.id == part_id).with_for_update()).one()
        if attempt.outcome is not None or part.state not in PART_UNLAUNCHED:
            continue
        name = session.scalar(select(Node.name).where(Node.id == part.node_id))
        fail_attempt(
            session, job, attempt,
            f"node rank {part.node_rank} on {name} was not confirmed launching within {timeout_s:g}s "
            "(attempt_launch_timeout_s): its agent never picked it up",
            node_id=part.node_id, kind="launch_error",
        )
        failed.append(attempt_id)
    return failed


def release_parts(session: Session, part_ids: Iterable[uuid.UUID]) -> set[uuid.UUID]:
    """Nodes confirmed the processes of these parts gone: release their leases, and end each
    attempt whose last held part this released (``end_if_released``), in this transaction. Returns
    the attempts of the parts released now (a part already released is skipped).

    Locks the parts' attempts (``locks.lock_attempts``, not their jobs), then the parts. The attempt
    lock serializes the releases of one gang: the release that gives back its last part counts
    the parts still held after every earlier release committed, so an attempt never holds no
    lease while it reads ``stopping`` (docs/architecture.md, "Synchronous failure and lease
    release"). The job lock is not taken: the 128 releases of a stopped 1,024-rank gang queue only
    on their attempt's row, for a few statements each, and a cancelling job is finished after the
    commit (``finish_released``). The caller holds no attempt part and no job after this in the
    lock order (a heartbeat: its node; a removal: the node and the jobs and attempts it locked).

    A part that follows a part not yet released (its leases were passed from it:
    services/runs/handover.py) is not released before that one, unless both are in ``part_ids``."""
    ids = sorted(set(part_ids))
    if not ids:
        return set()
    held = session.scalars(select(AttemptPart.attempt_id).where(
        AttemptPart.id.in_(ids), AttemptPart.released_at.is_(None))).all()
    if not held:
        return set()
    locked = lock_attempts(session, held)
    parts = _not_behind(session, [p for p in lock_parts(session, ids) if p.released_at is None])
    if not parts:
        return set()
    attempt_ids = {p.attempt_id for p in parts}
    job_of = {a.id: a.job_id for a in locked}
    t = now()
    released = dict.fromkeys(((p.attempt_id, p.node_id) for p in parts), 0)
    for attempt_id, node_id in session.execute(
        update(GpuLease)
        .where(GpuLease.released_at.is_(None),
               tuple_(GpuLease.attempt_id, GpuLease.node_id).in_(list(released)))
        .values(released_at=t)
        .returning(GpuLease.attempt_id, GpuLease.node_id)
    ).all():
        released[(attempt_id, node_id)] += 1
    for part in parts:
        part.released_at = t
        advance_part(session, part, "gone", job_id=job_of[part.attempt_id])
        given = released[(part.attempt_id, part.node_id)]
        passed = not given and session.scalar(
            select(AttemptPart.id).where(AttemptPart.follows_part_id == part.id).limit(1)) is not None
        events.record(
            session,
            "leases.released",
            f"node rank {part.node_rank} stopped; its GPU leases had passed to the job's next attempt" if passed
            else f"node rank {part.node_rank} stopped; {given} GPU leases released",
            job_id=job_of[part.attempt_id],
            attempt_id=part.attempt_id,
            node_id=part.node_id,
        )
    for attempt in locked:
        if attempt.id in attempt_ids:
            end_if_released(session, attempt)
    session.info["released"] = session.info.get("released", 0) + len(parts)  # lets the caller wake the scheduler
    session.info.setdefault(RELEASED_ATTEMPTS, set()).update(attempt_ids)
    return attempt_ids


def _not_behind(session: Session, parts: list[AttemptPart]) -> list[AttemptPart]:
    """``parts`` less those that follow a part not yet released and not among them: a part passed
    the leases of its job's previous part on its node (services/runs/handover.py, pass_leases) holds
    them until that part's processes are confirmed gone too, whatever its own agent says of it
    (it never started it while they lived). Its next release, a heartbeat later, gives them back."""
    ids = {p.id for p in parts}
    before = {p.follows_part_id for p in parts if p.follows_part_id is not None and p.follows_part_id not in ids}
    if not before:
        return parts
    held = set(session.scalars(select(AttemptPart.id).where(AttemptPart.id.in_(before),
                                                            AttemptPart.released_at.is_(None))))
    return [p for p in parts if p.follows_part_id not in held]


def end_if_released(session: Session, attempt: Attempt) -> bool:
    """End a decided attempt (outcome set) that holds no part any more; True if it ended now. The
    caller holds the attempt's lock and released its parts in this transaction (release_parts,
    handover.release_adopted), so the last lease and the attempt's end commit together: whatever
    reads both (the scheduler, a view, a test) never sees a stopping attempt that holds nothing. A
    cancelling job's ``cancelled`` needs the job lock, which a release does not take: that is
    ``finish_released``, after the commit. An attempt still undecided stays as it is: its verdict
    (settle) ends it under the job lock."""
    if attempt.outcome is None or attempt.state == "ended":
        return False
    session.flush()
    if session.scalar(select(func.count()).select_from(AttemptPart).where(
            AttemptPart.attempt_id == attempt.id, AttemptPart.released_at.is_(None))):
        return False
    set_attempt_state(session, attempt, "ended", f"attempt {attempt.number}: every node released its GPUs")
    # The whole gang is free: the caller may schedule at once (agent_protocol.heartbeat_and_schedule).
    session.info["attempts_ended"] = session.info.get("attempts_ended", 0) + 1
    return True


RECOVERING = "recovering"
"""session.info key: a failure this transaction decided sent its job to recover (the caller wakes the
scheduler after its commit: the next attempt need not wait for any release)."""

RELEASED_ATTEMPTS = "released_attempts"
"""session.info key: the attempts whose parts this transaction released (``finish_released`` after it)."""


def ended_count(session: Session) -> int:
    """How many attempts the session ended so far (finish_if_released counts them)."""
    return int(session.info.get("attempts_ended", 0))


def released_attempts(session: Session) -> set[uuid.UUID]:
    """The attempts whose parts the session released since this was last called."""
    ids: set[uuid.UUID] = session.info.pop(RELEASED_ATTEMPTS, set())
    return ids


def finish_released(session: Session, attempt_ids: Iterable[uuid.UUID]) -> int:
    """After a transaction that released parts (or lost nodes) committed: finish the cancelling job
    of each such attempt (finish_if_released, under the job and attempt locks), which the release
    itself could not (it holds no job lock); returns how many attempts ended here. Part of the
    caller's transaction.

    The release that gave back a gang's last part ended the attempt itself (``end_if_released``);
    so only a cancelling job's attempts, or a decided attempt that nothing ended (the monitor's
    sweep, ``finish_stopped``), take the job lock here. An unlocked read comes first, so that the
    other releases of a gang do not queue on its job row."""
    ended_before = ended_count(session)
    for attempt_id in attempt_order(session, attempt_ids):
        row = session.execute(
            select(Attempt.outcome, Attempt.state, Job.state.label("job_state"))
            .join(Job, Job.id == Attempt.job_id).where(Attempt.id == attempt_id)
        ).one_or_none()
        if row is None or row.outcome is None or (row.state == "ended" and row.job_state != "cancelling"):
            continue
        if row.job_state != "cancelling" and session.scalar(select(func.count()).select_from(AttemptPart).where(
                AttemptPart.attempt_id == attempt_id, AttemptPart.released_at.is_(None))):
            continue
        locked = lock_attempt(session, attempt_id)
        if locked is not None:
            finish_if_released(session, *locked)
    return ended_count(session) - ended_before


def finish_stopped(session: Session, *, batch: int = 200) -> int:
    """The monitor loop's sweep: finish what no transaction finished. A cancelling job whose
    attempt ended or may end (its releases cannot take the job lock, and the process may die
    before finish_released), or, as a safety net, a decided attempt that holds no part (every
    release and every decision ends such an attempt in its own transaction). Returns how many
    attempts ended."""
    holding = select(AttemptPart.id).where(AttemptPart.attempt_id == Attempt.id, AttemptPart.released_at.is_(None))
    ids = session.scalars(
        select(Attempt.id).join(Job, Job.id == Attempt.job_id)
        .where(or_(and_(Attempt.state == "stopping", ~holding.exists()),
                   and_(Job.state == "cancelling", Attempt.state.in_(("stopping", "ended")),
                        Job.current_attempt_id == Attempt.id)))
        .order_by(Attempt.id).limit(batch)
    ).all()
    return finish_released(session, ids)


def finish_if_released(session: Session, job: Job, attempt: Attempt) -> None:
    """Mark the attempt ended once every node released; finish a cancelling job.

    A cancelling job does not wait for a lost node: it is ``cancelled`` once every part is released
    or on a lost (or removed) node. That node's leases stay held, shown in the node view, until it
    returns and confirms or an operator removes it; only then does the attempt end.

    The caller holds the job and attempt locks (lock_attempt). Releases lock the attempt too
    (release_parts), so none is in flight: it sees every release committed before it, and a
    release after it sees the outcome it set and ends the attempt itself (end_if_released)."""
    if attempt.outcome is None:
        return
    session.flush()
    # A count, not the parts: most calls find the gang still held.
    holding = session.scalar(select(func.count()).select_from(AttemptPart).where(
        AttemptPart.attempt_id == attempt.id, AttemptPart.released_at.is_(None)))
    if holding and job.state != "cancelling":
        return
    held = reload(session, select(AttemptPart).where(
        AttemptPart.attempt_id == attempt.id, AttemptPart.released_at.is_(None))).all() if holding else []
    if not held and attempt.state != "ended":
        set_attempt_state(session, attempt, "ended", f"attempt {attempt.number}: every node released its GPUs")
        # The whole gang is free: the caller may schedule at once (agent_protocol.heartbeat_and_schedule).
        session.info["attempts_ended"] = session.info.get("attempts_ended", 0) + 1
    if job.state != "cancelling":
        return
    if not held:
        set_job_state(session, job, "cancelled", "every worker stopped and every lease released")
        return
    nodes = {n.id: n for n in session.scalars(select(Node).where(Node.id.in_([p.node_id for p in held])))}
    if all(nodes[p.node_id].state in NODE_UNREACHABLE for p in held):
        names = sorted(nodes[p.node_id].name for p in held)
        set_job_state(
            session, job, "cancelled",
            f"every reachable worker stopped; {', '.join(names)} lost: its GPU leases stay held on it until it "
            "returns or is removed",
            lost_nodes=names,
        )
