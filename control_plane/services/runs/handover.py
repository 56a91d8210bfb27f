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
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.models import Attempt, AttemptPart, GpuLease, Job
from control_plane.services import events
from control_plane.services.locks import lock_attempts, lock_parts
from control_plane.services.runs import parking
from control_plane.services.runs.attempts import RELEASED_ATTEMPTS, end_if_released
from control_plane.services.states import PART_PARKED, advance_part


@dataclass(frozen=True)
class ParkedPart:
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
