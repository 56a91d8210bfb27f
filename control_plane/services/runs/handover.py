"""Handover: a restartable job's next attempt takes over the parked parts of its previous one.

A part of a restartable job whose node was healthy when the attempt failed is ``parked`` by its
agent: its workers stay alive, waiting for their part of the next attempt, and its GPU leases stay
held. When a scheduling pass places the next attempt on exactly a parked part's GPUs
(scheduler/handover_policy.py), the same transaction transfers the leases (``take_over``): the
parked part's are released and the new attempt's inserted, so every GPU has one owner at every
statement and at commit (the unique index on active leases and the gang trigger check it); the
parked part goes to ``gone`` by the ``part.handed_over`` transition; the new part records what it
adopts (``adopts_attempt_id``, carried by its launch spec as ``adopts``). Its agent then hands the
parked workers the new attempt's assignment instead of starting processes.
docs/architecture.md, "In-process restart of healthy ranks".

Passing (``passable_parts``, ``pass_leases``): a job that parks nothing (not restartable, or a failure
its live workers may have caused) gets the GPUs of its failed attempt's stopping parts the same way,
without their processes: the pass places the next attempt on exactly a stopping part's GPUs and
transfers the leases, but the old part stays held (its processes are still stopping) and the new
part records it (``follows_part_id``). Its agent starts the new part once the old one's processes
are gone (node_agent/loops/desired.py holds a part whose GPUs a live part still has), and the new
part is never released before the old one (attempts.release_parts). So every GPU whose processes
may be alive stays leased to the job, and a recovery waits for no node's release, only for each
node's own processes (issue 27: 128 serialized releases were 7.4 s of a 1,024-rank recovery).
docs/architecture.md, "Synchronous failure and lease release".
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import exists, or_, select, tuple_, update
from sqlalchemy.orm import Session, aliased

from control_plane.clock import now
from control_plane.models import Attempt, AttemptPart, Checkpoint, GpuLease, Job
from control_plane.services import events
from control_plane.services.locks import lock_attempts, lock_parts
from control_plane.services.runs import parking
from control_plane.services.runs.attempts import RELEASED_ATTEMPTS, end_if_released
from control_plane.services.states import PART_PARKED, advance_part


@dataclass(frozen=True)
class ParkedPart:
    """A part of a job's failed current attempt whose GPUs its next attempt may take: parked (its
    workers are adopted) or, from ``passable_parts``, stopping (its leases are passed)."""

    part_id: uuid.UUID
    attempt_id: uuid.UUID
    node_id: uuid.UUID
    gpu_indices: tuple[int, ...]


def parked_parts(session: Session, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, dict[str, ParkedPart]]:
    """Per job, its parked parts by node id (text, as the policy names nodes): only parts of the job's
    current attempt, once that attempt failed, that may still be handed over (services/runs/parking.py:
    never the blamed node's, nor after a hang, a cancel or a time limit)."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    out: dict[uuid.UUID, dict[str, ParkedPart]] = {}
    for job_id, part_id, attempt_id, node_id, indices in session.execute(
        select(Job.id, AttemptPart.id, AttemptPart.attempt_id, AttemptPart.node_id, AttemptPart.gpu_indices)
        .join(Attempt, Attempt.id == Job.current_attempt_id)
        .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
        .where(Job.id.in_(ids), AttemptPart.state.in_(PART_PARKED), AttemptPart.released_at.is_(None),
               *parking.clauses())
    ):
        out.setdefault(job_id, {})[str(node_id)] = ParkedPart(part_id, attempt_id, node_id, tuple(sorted(indices)))
    return out


def take_over(session: Session, job: Job, adopted: Mapping[str, ParkedPart],
              gpus: Mapping[str, tuple[int, ...]]) -> bool:
    """Release the leases of the parked parts the new attempt of ``job`` adopts (node id -> part; the
    new attempt's GPU indices on that node in ``gpus``), in the caller's transaction, right before
    the new attempt's leases are inserted. The caller holds the nodes and the job (services/locks.py);
    the parts are locked here. False (nothing changed) if any of them is no longer parked on exactly
    those GPUs (its agent's handover timeout stopped it meanwhile) or may no longer be handed over
    (services/runs/parking.py, under the locks now): the job is not admitted this pass, and the next
    one places it afresh."""
    part_ids = [a.part_id for a in adopted.values()]
    # Their attempts before the parts (the lock order), so that the hand-over of an old attempt's
    # last part ends it in this transaction (attempts.end_if_released), as any release does.
    old_attempts = lock_attempts(session, session.scalars(
        select(AttemptPart.attempt_id).where(AttemptPart.id.in_(part_ids))).all())
    parts = {p.id: p for p in lock_parts(session, part_ids)}
    for node, parked in adopted.items():
        part = parts.get(parked.part_id)
        if (part is None or part.state not in PART_PARKED or part.released_at is not None
                or tuple(sorted(part.gpu_indices)) != tuple(sorted(gpus.get(node, ())))):
            return False
        attempt = session.get(Attempt, part.attempt_id)
        if attempt is None or parking.refusal(job, attempt, part) is not None:
            return False
    t = now()
    for part in sorted(parts.values(), key=lambda p: p.id):
        released = session.execute(
            update(GpuLease)
            .where(GpuLease.released_at.is_(None), GpuLease.attempt_id == part.attempt_id,
                   GpuLease.node_id == part.node_id)
            .values(released_at=t)
            .returning(GpuLease.id)
        ).all()
        part.released_at = t
        advance_part(session, part, "gone", job_id=job.id, kind="part.handed_over")
        events.record(
            session, "leases.handed_over",
            f"node rank {part.node_rank}: {len(released)} GPU leases handed over to the job's next attempt, "
            "with the workers holding them",
            job_id=job.id, attempt_id=part.attempt_id, node_id=part.node_id,
        )
    for attempt in old_attempts:
        end_if_released(session, attempt)
    session.info.setdefault(RELEASED_ATTEMPTS, set()).update(p.attempt_id for p in parts.values())
    return True


def passable_parts(session: Session, job_ids: Iterable[uuid.UUID]) -> dict[uuid.UUID, dict[str, ParkedPart]]:
    """Per recovering job that parks nothing (parking.PARKS is false for its failed attempt), the
    parts of that attempt not yet released, by node id (text): their GPUs may pass to the next
    attempt (``pass_leases``). Not the blamed node's (its GPUs are released as ever, and the job
    goes elsewhere if it can, as without passing), not a part that itself follows a part not yet
    released (its GPUs wait for that one's processes: one link at most), nor a parked one (handed
    over instead), and nothing while the attempt has a checkpoint collecting shards (its nodes'
    reports may still complete it; the next attempt is placed once they are released, as before)."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    before = aliased(AttemptPart)
    waiting = exists().where(before.id == AttemptPart.follows_part_id, before.released_at.is_(None))
    # A checkpoint of the failed attempt still collecting shards: its healthy nodes' reports drain
    # before their final status (node_agent/loops/report.py), and may complete it, while the attempt
    # is the job's current one. A next attempt now would fence them off and restore an older one.
    saving = exists().where(Checkpoint.attempt_id == Attempt.id, Checkpoint.state == "pending")
    out: dict[uuid.UUID, dict[str, ParkedPart]] = {}
    for job_id, part_id, attempt_id, node_id, indices in session.execute(
        select(Job.id, AttemptPart.id, AttemptPart.attempt_id, AttemptPart.node_id, AttemptPart.gpu_indices)
        .join(Attempt, Attempt.id == Job.current_attempt_id)
        .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
        .where(Job.id.in_(ids), Job.state == "recovering", Attempt.outcome == "failed",
               AttemptPart.released_at.is_(None), AttemptPart.state.not_in(PART_PARKED), ~waiting, ~saving,
               or_(Attempt.failed_node_id.is_(None), AttemptPart.node_id != Attempt.failed_node_id),
               or_(*parking.parks_nothing()))
    ):
        out.setdefault(job_id, {})[str(node_id)] = ParkedPart(part_id, attempt_id, node_id, tuple(sorted(indices)))
    return out


def pass_leases(session: Session, job: Job, passing: Mapping[str, ParkedPart],
                gpus: Mapping[str, tuple[int, ...]]) -> dict[uuid.UUID, uuid.UUID] | None:
    """Release the leases of the stopping parts (node id -> part) whose exact GPUs the new attempt of
    ``job`` takes (its GPU indices per node in ``gpus``), in the caller's transaction, right before
    the new attempt's leases are inserted; returns node id -> the part the new part there follows.
    The parts stay held: they are released when their nodes confirm their processes gone, as ever.
    The caller holds the nodes and the job (locked and still ``recovering`` from the attempt the
    parts belong to; else None: nothing changed, the next pass places the job afresh). The parts are
    locked here, all before any lease is touched: a release of one of them (which locks its attempt,
    its part, then its leases) either committed before (its GPUs are free: nothing to pass there)
    or waits for this transaction and then finds nothing left to release."""
    parts = {p.id: p for p in lock_parts(session, [s.part_id for s in passing.values()])}
    follows: dict[uuid.UUID, uuid.UUID] = {}
    for node, stopping in passing.items():
        part = parts.get(stopping.part_id)
        if (part is None or job.state != "recovering" or job.current_attempt_id != part.attempt_id
                or part.state in PART_PARKED or tuple(sorted(part.gpu_indices)) != tuple(sorted(gpus.get(node, ())))):
            return None
        if part.released_at is None:
            follows[part.node_id] = part.id
    if not follows:
        return {}
    t = now()
    by_node = {parts[part_id].node_id: parts[part_id] for part_id in follows.values()}
    passed = session.execute(
        update(GpuLease)
        .where(GpuLease.released_at.is_(None),
               tuple_(GpuLease.attempt_id, GpuLease.node_id).in_([(p.attempt_id, p.node_id) for p in by_node.values()]))
        .values(released_at=t)
        .returning(GpuLease.node_id)
    ).scalars().all()
    attempt_id = next(iter(by_node.values())).attempt_id
    events.record(
        session, "leases.passed",
        f"{len(passed)} GPU leases on {len(follows)} nodes passed to the job's next attempt while the processes of "
        "this attempt's parts there stop: each node starts its new part once they are gone",
        job_id=job.id, attempt_id=attempt_id, nodes=len(follows), gpus=len(passed),
    )
    return follows
