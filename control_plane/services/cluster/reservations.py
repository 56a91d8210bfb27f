"""Reservations and the recovery reserve as rows: what the scheduler holds idle and its cost.

The policy (scheduler/policy.py) decides, every pass, which free GPUs it holds for blocked jobs
and for recoveries; this module keeps one row per hold and accounts its idle cost: each pass adds
``held_gpus`` x (now - ``updated_at``) to ``idle_gpu_seconds`` and writes the new ``held_gpus``
(the GPUs held are piecewise constant between passes). See docs/architecture.md, "Reservations".
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.models import Job, Node
from control_plane.models import Reservation as ReservationRow
from control_plane.schemas.scheduling import RecoveryReserveOut, ReservationOut, SchedulingOut
from control_plane.services import events

JOB, RESERVE = "job", "recovery-reserve"


@dataclass(frozen=True)
class JobHold:
    """A blocked job's reservation after a pass."""

    job_id: uuid.UUID
    node_ids: list[uuid.UUID]
    earliest_start: datetime | None
    held_gpus: int


@dataclass(frozen=True)
class ReserveRecord:
    """What a pass records of the recovery reserve of a GPU kind: the policy's decision
    (scheduler/model.py ``ReserveHold``, string ids) with database ids and the jobs it served.
    A separate class because services may not import the scheduler (the layers contract)."""

    gpu_kind: str
    node_ids: list[uuid.UUID]
    idle_gpus: int
    served: int
    """Recovering jobs placed on it by this pass."""


def has_active(session: Session) -> bool:
    return session.scalar(select(ReservationRow.id).where(ReservationRow.ended_at.is_(None)).limit(1)) is not None


def previous(session: Session) -> dict[str, list[str]]:
    """Job id -> node ids of the active reservations, oldest first (the policy keeps them)."""
    rows = session.execute(
        select(ReservationRow.job_id, ReservationRow.node_ids)
        .where(ReservationRow.ended_at.is_(None), ReservationRow.kind == JOB)
        .order_by(ReservationRow.seq)  # a pass makes many at one created_at: in the order it made them
    )
    return {str(job_id): [str(n) for n in node_ids] for job_id, node_ids in rows}


def previous_starts(session: Session) -> dict[str, datetime | None]:
    """Job id -> earliest start of the active reservations (None: unknown): a kept reservation
    starts from there, so one planned around it is not delayed when it moves (scheduler/reserving.py)."""
    rows = session.execute(
        select(ReservationRow.job_id, ReservationRow.earliest_start)
        .where(ReservationRow.ended_at.is_(None), ReservationRow.kind == JOB)
    )
    return {str(job_id): start for job_id, start in rows}


def _accrue(row: ReservationRow, at: datetime) -> None:
    elapsed = (at - row.updated_at).total_seconds()
    if elapsed > 0:
        row.idle_gpu_seconds += row.held_gpus * elapsed
    row.updated_at = max(at, row.updated_at)


def record(
    session: Session,
    *,
    at: datetime,
    holds: Iterable[JobHold],
    reserve: Iterable[ReserveRecord],
    started: set[uuid.UUID],
    waiting: Collection[str],
) -> None:
    """Account the pass at ``at`` (in the caller's transaction): accrue every active row's cost
    until now, then write what is held from now on; end the rows no longer held. ``started``: jobs
    the pass admitted; ``waiting``: ids (text) of jobs still waiting after it."""
    active = list(session.scalars(
        select(ReservationRow).where(ReservationRow.ended_at.is_(None)).with_for_update()
    ))
    for row in active:
        _accrue(row, at)
    by_job = {row.job_id: row for row in active if row.kind == JOB}
    by_kind = {row.gpu_kind: row for row in active if row.kind == RESERVE}
    for h in holds:
        held = by_job.pop(h.job_id) if h.job_id in by_job else _new_job_row(session, h, at)
        held.node_ids = list(h.node_ids)
        held.earliest_start = h.earliest_start
        held.held_gpus = h.held_gpus
    for job_id, gone in by_job.items():
        gone.ended_at = at
        gone.held_gpus = 0
        gone.end_reason = ("started" if job_id in started else
                           "released" if str(job_id) in waiting else "the job left the queue")
    for r in reserve:
        spare = by_kind.pop(r.gpu_kind) if r.gpu_kind in by_kind else None
        if spare is None:
            spare = ReservationRow(id=uuid.uuid4(), kind=RESERVE, gpu_kind=r.gpu_kind, created_at=at,
                                   updated_at=at, idle_gpu_seconds=0.0, served=0)
            session.add(spare)
        spare.node_ids = list(r.node_ids)
        spare.held_gpus = r.idle_gpus
        spare.served += r.served
    for off in by_kind.values():
        off.ended_at = at
        off.held_gpus = 0
        off.end_reason = "recovery reserve turned off"


def _new_job_row(session: Session, h: JobHold, at: datetime) -> ReservationRow:
    row = ReservationRow(id=uuid.uuid4(), kind=JOB, job_id=h.job_id, created_at=at, updated_at=at,
                         first_earliest_start=h.earliest_start, idle_gpu_seconds=0.0, served=0)
    session.add(row)
    start = h.earliest_start.isoformat() if h.earliest_start else None
    events.record(session, "job.reserved", f"{len(h.node_ids)} nodes reserved; earliest start {start or 'unknown'}",
                  job_id=h.job_id, nodes=[str(n) for n in h.node_ids], earliest_start=start)
    return row


def _live_cost(row: ReservationRow, at: datetime) -> float:
    """Cost so far, including the part since the last pass."""
    if row.ended_at is not None:
        return row.idle_gpu_seconds
    return row.idle_gpu_seconds + row.held_gpus * max(0.0, (at - row.updated_at).total_seconds())


def reservation_out(row: ReservationRow, job_name: str, names: dict[uuid.UUID, str], at: datetime) -> ReservationOut:
    return ReservationOut(
        job_id=str(row.job_id), job_name=job_name, nodes=[names.get(n, str(n)) for n in row.node_ids],
        earliest_start=row.earliest_start, first_earliest_start=row.first_earliest_start,
        held_gpus=row.held_gpus, idle_gpu_seconds=round(_live_cost(row, at), 3), since=row.created_at,
    )


def _names(session: Session, rows: Iterable[ReservationRow]) -> dict[uuid.UUID, str]:
    ids = {n for row in rows for n in row.node_ids}
    if not ids:
        return {}
    return dict(session.execute(select(Node.id, Node.name).where(Node.id.in_(ids))).all())


def active_for_jobs(session: Session, job_ids: list[uuid.UUID]) -> dict[uuid.UUID, ReservationOut]:
    """The active reservation of each of these jobs that holds one (for the job view)."""
    if not job_ids:
        return {}
    rows = session.execute(
        select(ReservationRow, Job.name).join(Job, Job.id == ReservationRow.job_id)
        .where(ReservationRow.job_id.in_(job_ids), ReservationRow.ended_at.is_(None), ReservationRow.kind == JOB)
    ).all()
    names = _names(session, [r for r, _ in rows])
    at = now()
    return {row.job_id: reservation_out(row, name, names, at) for row, name in rows if row.job_id is not None}


def summary(session: Session) -> SchedulingOut:
    at = now()
    active = session.execute(
        select(ReservationRow, Job.name).join(Job, Job.id == ReservationRow.job_id)
        .where(ReservationRow.ended_at.is_(None), ReservationRow.kind == JOB)
        .order_by(ReservationRow.created_at)
    ).all()
    reserve_rows = list(session.scalars(select(ReservationRow).where(ReservationRow.kind == RESERVE)))
    names = _names(session, [r for r, _ in active] + [r for r in reserve_rows if r.ended_at is None])
    ended_cost, started, estimated, on_time = session.execute(
        select(
            func.coalesce(func.sum(ReservationRow.idle_gpu_seconds), 0.0),
            func.count().filter(ReservationRow.end_reason == "started"),
            func.count().filter(ReservationRow.end_reason == "started",
                                ReservationRow.first_earliest_start.is_not(None)),
            func.count().filter(ReservationRow.end_reason == "started",
                                ReservationRow.ended_at <= ReservationRow.first_earliest_start),
        ).where(ReservationRow.kind == JOB, ReservationRow.ended_at.is_not(None))
    ).one()
    live = [reservation_out(row, name, names, at) for row, name in active]
    reserve: dict[str, RecoveryReserveOut] = {}
    for row in sorted(reserve_rows, key=lambda r: r.created_at):
        kind = row.gpu_kind or ""
        prev = reserve.get(kind)
        current = row.ended_at is None
        reserve[kind] = RecoveryReserveOut(
            gpu_kind=kind,
            nodes=[names.get(n, str(n)) for n in row.node_ids] if current else (prev.nodes if prev else []),
            idle_gpus=row.held_gpus if current else (prev.idle_gpus if prev else 0),
            idle_gpu_seconds=round(_live_cost(row, at) + (prev.idle_gpu_seconds if prev else 0.0), 3),
            recoveries_served=row.served + (prev.recoveries_served if prev else 0),
        )
    return SchedulingOut(
        reservations=live,
        reservation_idle_gpu_seconds=round(float(ended_cost) + sum(r.idle_gpu_seconds for r in live), 3),
        reservations_started=started, reservations_started_estimated=estimated, reservations_started_on_time=on_time,
        recovery_reserve=list(reserve.values()),
    )
