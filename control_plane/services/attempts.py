"""Attempts: one run of a job on a gang of GPUs, owned by a fencing token.

An attempt is ``starting`` -> ``running`` -> ``stopping`` -> ``ended``. It is decided (outcome
set, nodes told to stop) in ``end_attempt``; it is over (``ended``) only when every node has
confirmed that its processes are gone and its leases are released. Reports are fenced: only the
job's current attempt, with the right token, can change anything, and merges are monotonic, so a
duplicated or late report never moves a state backwards. See docs/architecture.md.
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any, Protocol

from sqlalchemy import and_, func, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session

from control_plane import wakeups
from control_plane.clock import now
from control_plane.db import reload
from control_plane.errors import Forbidden, InvalidState
from control_plane.models import Attempt, AttemptNode, Gpu, GpuLease, Job, Node, Worker
from control_plane.services import events, intervals, memtier, parking, progress, specs
from control_plane.services.checkpoints import restore_plan
from control_plane.services.fencing import authorize_report, check_own_ranks, check_worker_block, lock_attempt
from control_plane.services.locks import attempt_order, lock_attempts, lock_part, lock_parts
from control_plane.services.states import (
    JOB_ACTIVE,
    JOB_TERMINAL,
    NODE_UNREACHABLE,
    PART_DONE,
    PART_ORDER,
    PART_PARKED,
    PART_STARTED,
    PART_UNLAUNCHED,
    advance_part,
    set_attempt_state,
    set_job_state,
)
from trainyard.protocol.agent import AttemptStatusReport
from trainyard.protocol.exits import message_step

WORKER_ORDER = {"starting": 0, "running": 1, "exited": 2}
NODE_ORDER = PART_ORDER


class NodeLike(Protocol):
    """What placing an attempt needs of a node (a ``Node`` row, or the scheduler's light copy)."""

    @property
    def id(self) -> uuid.UUID: ...
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...


NodePlacement = Sequence[tuple[NodeLike, Sequence[int]]]
"""Node rank i is ``placement[i]``: the node and its GPU indices."""


def create_attempt(session: Session, job: Job, placement: NodePlacement, *, rdzv_port: int,
                   topology_label: str = "rack") -> Attempt:
    """Create the attempt, its per-node parts and every GPU lease, in the caller's transaction.

    The database refuses a lease on a GPU that is already leased, and refuses at commit an
    attempt whose leases do not cover its whole gang.
    """
    (attempt_id,) = create_attempts(session, [(job, placement, rdzv_port)], topology_label=topology_label)
    attempt = session.get(Attempt, attempt_id)
    assert attempt is not None
    return attempt


def create_attempts(session: Session, allocations: Sequence[tuple[Job, NodePlacement, int]], *,
                    adopts: Mapping[uuid.UUID, Mapping[uuid.UUID, uuid.UUID]] | None = None,
                    topology_label: str = "rack") -> list[uuid.UUID]:
    """``create_attempt`` for many (job, placement, rendezvous port) at once: a scheduling pass may
    admit hundreds of gangs, so attempts, parts and leases go in as three bulk INSERTs. The jobs
    must be locked by the caller and waiting; each moves to ``starting``. Returns the attempt ids.
    ``adopts``: per job, per node, the earlier attempt whose parked part there the new part takes
    over (services/handover.py released its leases first, in this transaction).
    """
    adopts = adopts or {}
    if not allocations:
        return []
    job_ids = [job.id for job, _, _ in allocations]
    last: dict[uuid.UUID, int] = {
        job_id: number
        for job_id, number in session.execute(
            select(Attempt.job_id, func.max(Attempt.number)).where(Attempt.job_id.in_(job_ids))
            .group_by(Attempt.job_id)
        )
    }
    node_ids = {node.id for _, placement, _ in allocations for node, _ in placement}
    gpus = {
        (node_id, index): (gpu_id, kind)
        for gpu_id, node_id, index, kind in session.execute(
            select(Gpu.id, Gpu.node_id, Gpu.index, Gpu.kind).where(Gpu.node_id.in_(node_ids))
        )
    }
    t = now()
    attempt_rows: list[dict[str, Any]] = []
    part_rows: list[dict[str, Any]] = []
    lease_rows: list[dict[str, Any]] = []
    peers = memtier.Peers(session, topology_label)
    for job, placement, port in allocations:
        attempt_id = uuid.uuid4()
        earlier = last.get(job.id)
        attempt_rows.append({
            "id": attempt_id, "job_id": job.id, "number": (earlier or 0) + 1,
            "fencing_token": secrets.token_hex(24), "state": "starting", "num_gpus": job.num_gpus,
            "gpu_kind": gpus[(placement[0][0].id, placement[0][1][0])][1],  # a gang is of one kind
            "rdzv_host": placement[0][0].address, "rdzv_port": port, "created_at": t,
            # Only a job that ran before can have checkpoints to restore from.
            "restore_manifest": restore_plan(session, job) if earlier else None,
            "checkpoint_interval_steps": intervals.launch_steps(job),
        })
        memory = peers.blocks(job, [node.id for node, _ in placement], earlier)
        for node_rank, (node, indices) in enumerate(placement):
            part = {"id": uuid.uuid4(), "attempt_id": attempt_id, "node_id": node.id, "node_rank": node_rank,
                    "gpu_indices": list(indices), "desired": "run", "state": "assigned", "memory": memory[node_rank],
                    "adopts_attempt_id": adopts.get(job.id, {}).get(node.id)}
            # Its spec never changes from now on: versioned once (services/specs.py).
            part["spec_version"] = specs.launch_spec(job, SimpleNamespace(**attempt_rows[-1]),
                                                     SimpleNamespace(**part), None).version
            part_rows.append(part)
            lease_rows += [
                {"id": uuid.uuid4(), "gpu_id": gpus[(node.id, index)][0], "node_id": node.id,
                 "attempt_id": attempt_id, "job_id": job.id, "created_at": t}
                for index in indices
            ]
    session.execute(insert(Attempt), attempt_rows)
    session.execute(insert(AttemptNode), part_rows)
    wakeups.notify_nodes(session, {row["node_id"] for row in part_rows})  # wake their long polls
    session.execute(insert(GpuLease), lease_rows)
    batch = events.Batch()
    for (job, placement, port), row in zip(allocations, attempt_rows, strict=True):
        number, attempt_id = row["number"], row["id"]
        job.current_attempt_id = attempt_id
        layout = [{"node": n.name, "node_rank": r, "gpus": list(ix)} for r, (n, ix) in enumerate(placement)]
        set_job_state(
            session,
            job,
            "starting",
            f"attempt {number} allocated {job.num_gpus} GPUs on {len(placement)} nodes",
            attempt_id=str(attempt_id),
            placement=layout,
            batch=batch,
        )
        batch.add(
            "attempt.allocated",
            f"attempt {number} gang-allocated",
            job_id=job.id,
            attempt_id=attempt_id,
            placement=layout,
            rendezvous=f"{row['rdzv_host']}:{port}",
        )
    batch.write(session)
    return [row["id"] for row in attempt_rows]


def end_attempt(session: Session, attempt: Attempt, *, outcome: str, reason: str) -> bool:
    """Decide the attempt's outcome once and tell every node to stop. Idempotent."""
    if attempt.outcome is not None:
        return False
    attempt.outcome = outcome
    attempt.end_reason = reason
    if outcome != "succeeded":
        attempt.failed_at = now()
    stopped = session.scalars(
        update(AttemptNode).where(AttemptNode.attempt_id == attempt.id).values(desired="stop")
        .returning(AttemptNode.node_id)
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
    heartbeat does not list it (or the node is removed)."""
    cutoff = now() - timedelta(seconds=timeout_s)
    rows = session.execute(
        select(AttemptNode.attempt_id, AttemptNode.id)
        .join(Attempt, Attempt.id == AttemptNode.attempt_id)
        .where(AttemptNode.state.in_(PART_UNLAUNCHED), AttemptNode.released_at.is_(None),
               Attempt.outcome.is_(None), Attempt.created_at < cutoff)
        .order_by(AttemptNode.attempt_id, AttemptNode.node_rank)
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
        part = reload(session, select(AttemptNode).where(AttemptNode.id == part_id).with_for_update()).one()
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
    lock order (a heartbeat: its node; a removal: the node and the jobs and attempts it locked)."""
    ids = sorted(set(part_ids))
    if not ids:
        return set()
    held = session.scalars(select(AttemptNode.attempt_id).where(
        AttemptNode.id.in_(ids), AttemptNode.released_at.is_(None))).all()
    if not held:
        return set()
    locked = lock_attempts(session, held)
    parts = [p for p in lock_parts(session, ids) if p.released_at is None]
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
        events.record(
            session,
            "leases.released",
            f"node rank {part.node_rank} stopped; {released[(part.attempt_id, part.node_id)]} GPU leases released",
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
    if session.scalar(select(func.count()).select_from(AttemptNode).where(
            AttemptNode.attempt_id == attempt.id, AttemptNode.released_at.is_(None))):
        return False
    set_attempt_state(session, attempt, "ended", f"attempt {attempt.number}: every node released its GPUs")
    # The whole gang is free: the caller may schedule at once (agent_protocol.heartbeat_and_schedule).
    session.info["attempts_ended"] = session.info.get("attempts_ended", 0) + 1
    return True


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
        if row.job_state != "cancelling" and session.scalar(select(func.count()).select_from(AttemptNode).where(
                AttemptNode.attempt_id == attempt_id, AttemptNode.released_at.is_(None))):
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
    holding = select(AttemptNode.id).where(AttemptNode.attempt_id == Attempt.id, AttemptNode.released_at.is_(None))
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
    holding = session.scalar(select(func.count()).select_from(AttemptNode).where(
        AttemptNode.attempt_id == attempt.id, AttemptNode.released_at.is_(None)))
    if holding and job.state != "cancelling":
        return
    held = reload(session, select(AttemptNode).where(
        AttemptNode.attempt_id == attempt.id, AttemptNode.released_at.is_(None))).all() if holding else []
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


@dataclass(frozen=True)
class StatusMerged:
    """What merging one status report did (phase 1), and whether phase 2 may have to decide."""

    attempt: Attempt
    part: AttemptNode
    released: bool
    """The part's GPUs were released before this report."""
    release: bool
    """The report said no process is left of a done part still held: ``release_reported`` releases
    it once phase 1 (and phase 2, if any) committed."""
    settle: bool
    """Phase 2 (``settle``) may have something to decide once this report committed."""


def apply_status(
    session: Session, node: Node, attempt_id: uuid.UUID, report: AttemptStatusReport
) -> StatusMerged:
    """Phase 1 of a level-triggered status report: merge it into the node's own part, its workers
    and its progress, under shared job and attempt locks (fencing holds, as for shard reports) and
    the part's own lock. It writes no row of the job or the attempt, so the reports of a job's 128
    nodes do not wait for each other. A final report that says no process is left has its part's
    GPUs released right after (``release``: the node confirmed it, as its heartbeat would a period
    later), in a transaction of its own: a release locks the attempt (release_parts), which a
    holder of its share lock must not.

    Whatever the report may change of the attempt or the job (a failure, every worker running,
    every node exited 0, the result) is decided by ``settle``
    once this transaction committed, under the exclusive locks: it reads what every report
    committed before it, so of two reports that complete a condition at once, the later one sees
    both."""
    job, attempt, part = authorize_report(session, node, attempt_id, report.fencing_token, report.node_rank,
                                          exclusive=False)
    part = lock_part(session, part.id)
    if report.state.value in PART_PARKED:
        _check_parkable(job, attempt, part)
    t = now()
    part.reported_at = t
    _mark_timings(part, attempt, report, t)
    moved = advance_part(session, part, report.state.value, job_id=job.id)
    if moved and report.exit_code is not None:
        part.exit_code = report.exit_code
    if moved and part.state in PART_PARKED:
        session.info[PARKED] = True  # a pass may hand it over now: the caller wakes the scheduler
    if report.error and not part.error:
        part.error = report.error
        part.error_kind = report.error_kind
    _merge_workers(session, attempt, part, report)
    # Progress only moves forward within a part; the views take the furthest part (services/progress.py).
    if report.progress is not None and (part.progress_step is None or report.progress.step >= part.progress_step):
        _advance(part, report.progress.step, t)  # before merge: it compares with the step before
        first = part.first_progress_at is None
        progress.merge(session, job.id, attempt.number, part, report.progress, t)
        if first:
            session.info["first_step_at"] = t  # may end a recovery (agent_protocol: its phases)
    if report.ranks is not None and report.ranks.ranks and _own_ranks(session, part, report):
        part.ranks, part.ranks_at = report.ranks.model_dump(mode="json"), t
    release = report.processes_alive is False and part.state in PART_DONE and part.released_at is None
    # Global rank 0 reports the result. The agent pins torchrun's node order (node_agent/part/commands.py)
    # so it runs on node rank 0, but another launcher may put it elsewhere: the part that holds
    # worker rank 0 (as reported, checked by _merge_workers) is the one. settle publishes it.
    if report.result is not None and job.result is None and not _holds_rank_zero(session, part):
        raise Forbidden(f"node rank {part.node_rank} does not run global rank 0: only that node reports the "
                        "job's result")
    session.flush()
    settle = (report.result is not None and job.result is None) or (attempt.outcome is None and (
        report.state.value in PART_DONE or part.error is not None
        or any(w.exit_code not in (0, None) for w in report.workers)
        or (attempt.state == "starting" and part.state == "running")
        or (part.state in PART_STARTED and _failure_undecided(session, attempt.id))))
    return StatusMerged(attempt=attempt, part=part, released=part.released_at is not None, release=release,
                        settle=settle)


def release_reported(session: Session, part_id: uuid.UUID) -> bool:
    """The release a final status report asked for (``StatusMerged.release``), after its phases
    committed: after ``settle``, so that a verdict the report completes is taken before the part is
    given back, and the release of the gang's last part ends the attempt with it. Part of the
    caller's transaction; True once the part is released (by this call or before)."""
    release_parts(session, [part_id])
    return session.scalar(select(AttemptNode.released_at).where(AttemptNode.id == part_id)) is not None


PARKED = "parked"
"""session.info key: a report parked a part (the caller wakes the scheduler after its commit)."""


def _check_parkable(job: Job, attempt: Attempt, part: AttemptNode) -> None:
    """Only a part its agent was allowed to park (services/parking.py) may be parked: any other is
    never held back from stopping (its GPUs would stay leased to workers nobody should hand
    anything to)."""
    why = parking.refusal(job, attempt, part)
    if why is not None:
        raise InvalidState(f"node rank {part.node_rank} cannot be parked: {why}")


def _mark_timings(part: AttemptNode, attempt: Attempt, report: AttemptStatusReport, t: datetime) -> None:
    """The instants the agent reports as ages (its monotonic clock), on our clock: once each. Never
    before the attempt existed: a report's own latency is the only error, and it can only make an
    instant later."""
    if report.received_s_ago is not None and part.received_at is None:
        part.received_at = max(attempt.created_at, t - timedelta(seconds=report.received_s_ago))
    if report.initialized_s_ago is not None and part.initialized_at is None:
        part.initialized_at = max(attempt.created_at, t - timedelta(seconds=report.initialized_s_ago))


def settle(session: Session, attempt_id: uuid.UUID, result: dict[str, Any] | None = None) -> Attempt | None:
    """Phase 2 of a status report, after phase 1 committed: decide what the attempt's committed
    reports together say (``_verdict``), publish the job's result, end a released gang. An
    unlocked read first; the job and attempt locks only when there is something to do, and the
    verdict is taken again under them. Part of the caller's transaction; returns the attempt."""
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    if attempt is None:
        return None
    publish = result is not None and session.scalar(select(Job.result).where(Job.id == attempt.job_id)) is None
    if not publish and (attempt.outcome is not None or _verdict(session, attempt) is None):
        return attempt  # a release ends a decided gang itself (release_parts)
    locked = lock_attempt(session, attempt_id)
    if locked is None:
        return attempt
    job, attempt = locked
    # Only the part holding global rank 0 got here with a result (apply_status checked it).
    if result is not None and job.result is None:
        job.result = result
    if attempt.outcome is None:
        _decide(session, job, attempt)
    finish_if_released(session, job, attempt)
    return attempt


STEP_TIME_WEIGHT = 0.3
"""Weight of the newest advance in the smoothed step time (an exponential moving average)."""


def _advance(part: AttemptNode, step: int, t: datetime) -> None:
    """The part's step grew (or was first seen) at ``t``: the hang watchdog's clock and step time,
    kept on the part so that a report writes only its own node's row. The first advance after the
    first step is the first measurement (the first step includes the restore)."""
    before, since = part.progress_step, part.step_advanced_at
    if before is not None and step <= before:
        return
    if before is not None and since is not None and part.first_progress_at is not None:
        seconds = max((t - since).total_seconds(), 0.0) / (step - before)
        part.step_time_s = seconds if part.step_time_s is None else (
            STEP_TIME_WEIGHT * seconds + (1 - STEP_TIME_WEIGHT) * part.step_time_s)
    part.step_advanced_at = t


def _own_ranks(session: Session, part: AttemptNode, report: AttemptStatusReport) -> bool:
    """Whether the node's rank summary names only its own ranks; one that does not is left out (the
    rest of the report, its exits above all, still counts)."""
    assert report.ranks is not None
    try:
        check_own_ranks(session, part, {r.rank for r in report.ranks.ranks})
    except Forbidden:
        return False
    return True


def _failure_undecided(session: Session, attempt_id: uuid.UUID) -> bool:
    """A worker of the undecided attempt failed: its verdict may wait for a cause's report
    (_consequence_pending), so a running part's report asks settle again."""
    return session.scalar(select(Worker.id).where(
        Worker.attempt_id == attempt_id, Worker.exit_code.is_not(None), Worker.exit_code != 0).limit(1)) is not None


def _holds_rank_zero(session: Session, part: AttemptNode) -> bool:
    return session.scalar(select(Worker.attempt_node_id).where(Worker.attempt_id == part.attempt_id,
                                                                Worker.rank == 0)) == part.id


def _merge_workers(session: Session, attempt: Attempt, part: AttemptNode, report: AttemptStatusReport) -> None:
    """Merge the node's workers, which must be its own: one node's block of ranks, none of them
    another node's (fencing.check_own_ranks)."""
    if report.workers:
        check_worker_block([(w.rank, w.local_rank) for w in report.workers], world=attempt.num_gpus,
                           per_node=max(1, len(part.gpu_indices)))
        check_own_ranks(session, part, {w.rank for w in report.workers})
    existing = {
        w.rank: w for w in session.scalars(select(Worker).where(Worker.attempt_node_id == part.id))
    }
    for ws in report.workers:
        w = existing.get(ws.rank)
        if w is None:
            w = Worker(
                attempt_id=attempt.id,
                attempt_node_id=part.id,
                rank=ws.rank,
                local_rank=ws.local_rank,
                state="starting",
            )
            session.add(w)
            existing[ws.rank] = w
        if WORKER_ORDER[ws.state.value] >= WORKER_ORDER[w.state]:
            w.state = ws.state.value
            w.pid = ws.pid or w.pid
            w.started_at = w.started_at or ws.started_at
            if ws.state.value == "exited" and w.exit_code is None:
                w.exit_code = ws.exit_code
                w.ended_at = ws.ended_at or now()
                if ws.exit_code not in (0, None):
                    w.exit_cause = ws.cause or ("signal" if (ws.exit_code or 0) < 0 else "exit_code")
                    w.exit_message = ws.message


_TORCHRUN_SIGNAL = re.compile(r"exitcode: -\d+")


def _part_failure(part: AttemptNode) -> str:
    """The kind of a node part's failure when no worker's exit says it: never launched, or torchrun
    ended non-zero (a worker or its shim killed by a signal, by torchrun's own account, or not)."""
    if part.error_kind is not None:
        return part.error_kind
    if part.exit_code is None:
        return "launch_error"
    if part.exit_code < 0 or _TORCHRUN_SIGNAL.search(part.error or ""):
        return "signal"
    return "exit_code"


CONSEQUENCE_GRACE_S = 3.0
"""How long a failure that looks like the consequence of another (a collective error) waits for the
cause's report before it is decided on its own."""


def _recent(ended: Sequence[datetime | None]) -> bool:
    # ended_at is the node's clock: a clock ahead of ours (negative age) never defers the decision.
    ages = [(now() - t).total_seconds() for t in ended if t is not None]
    return bool(ages) and all(0 <= age < CONSEQUENCE_GRACE_S for age in ages)


@dataclass(frozen=True)
class _Verdict:
    """What an undecided attempt's committed reports say together."""

    failure: tuple[str, uuid.UUID, str] | None
    """The reason, the node to blame and the kind (trainyard.protocol.exits), when a worker or a
    node failed."""
    all_running: bool
    """A starting attempt whose every worker runs (or ran)."""
    succeeded: bool
    """Every node exited with code 0."""
    message: str | None = None
    """The failed worker's own message (its exception, and the step), when a worker failed."""


def _verdict(session: Session, attempt: Attempt) -> _Verdict | None:
    """Aggregates over the attempt's parts and workers (not every row: a 1,024-rank attempt has 1,024
    workers); None when there is nothing to decide."""
    # A part stopped at one of its resource limits is the cause, whatever its workers' exits say: the
    # kernel or its agent killed them for it (a memory hog's worker reads "killed by SIGKILL").
    limited = session.execute(
        select(AttemptNode.node_rank, AttemptNode.error, AttemptNode.node_id)
        .where(AttemptNode.attempt_id == attempt.id, AttemptNode.error_kind == "resource_limit")
        .order_by(AttemptNode.node_rank).limit(1)).one_or_none()
    if limited is not None:
        name = session.scalar(select(Node.name).where(Node.id == limited.node_id))
        return _Verdict((f"node rank {limited.node_rank} on {name}: {limited.error}", limited.node_id,
                         "resource_limit"), False, False)
    failed = (Worker.attempt_id == attempt.id, Worker.state == "exited", Worker.exit_code.is_not(None),
              Worker.exit_code != 0)
    # A script that cannot start is the cause wherever it shows; then a rank's own failure before a
    # peer's collective error; then the first to die.
    first = session.execute(
        select(Worker.rank, Worker.exit_code, Worker.exit_cause, Worker.exit_message, AttemptNode.node_id)
        .join(AttemptNode, AttemptNode.id == Worker.attempt_node_id)
        .where(*failed)
        .order_by(func.coalesce(Worker.exit_cause, "") != "start_error",
                  func.coalesce(Worker.exit_cause, "") == "collective_timeout",
                  Worker.ended_at.asc().nulls_last(), Worker.rank).limit(1)
    ).one_or_none()
    if first is not None:
        if first.exit_cause == "collective_timeout" and _consequence_pending(session, attempt, failed):
            return None
        name = session.scalar(select(Node.name).where(Node.id == first.node_id))
        plain = f"exited with code {first.exit_code}"  # a plain exit's message says no more than this
        said = f": {first.exit_message}" if first.exit_message and first.exit_message != plain else ""
        return _Verdict((f"rank {first.rank} on {name} {plain}{said}", first.node_id,
                         first.exit_cause or "exit_code"), False, False, first.exit_message)
    bad = session.execute(
        select(AttemptNode)
        .where(AttemptNode.attempt_id == attempt.id,
               or_(AttemptNode.error.is_not(None),
                   and_(AttemptNode.state.in_(PART_DONE), AttemptNode.exit_code.is_not(None),
                        AttemptNode.exit_code != 0)))
        .order_by(AttemptNode.node_rank).limit(1)
    ).scalar_one_or_none()
    if bad is not None:
        name = session.scalar(select(Node.name).where(Node.id == bad.node_id))
        detail = bad.error or f"torchrun exited with code {bad.exit_code}"
        return _Verdict((f"node rank {bad.node_rank} on {name}: {detail}", bad.node_id, _part_failure(bad)),
                        False, False)
    all_running = attempt.state == "starting" and (session.scalar(
        select(func.count()).select_from(Worker)
        .where(Worker.attempt_id == attempt.id, Worker.state.in_(("running", "exited")))) or 0) >= _workers_expected(
            session, attempt)
    # A node part may already be "gone" (released) when the last node's exit report arrives.
    unfinished = session.scalar(
        select(func.count()).select_from(AttemptNode)
        .where(AttemptNode.attempt_id == attempt.id,
               or_(AttemptNode.state.not_in(("exited", "gone")), AttemptNode.exit_code.is_(None),
                   AttemptNode.exit_code != 0)))
    if not all_running and unfinished:
        return None
    return _Verdict(None, all_running, not unfinished)


def _workers_expected(session: Session, attempt: Attempt) -> int:
    """The workers an attempt's parts report: every rank under torchrun; one per node for a
    ``command`` job, whose part is its own launcher's and is reported as a whole (the node's first
    rank: node_agent/part/commands.py, command_argv)."""
    command, nodes = session.execute(select(Job.command, Job.num_nodes).where(Job.id == attempt.job_id)).one()
    return nodes if command else attempt.num_gpus


def _consequence_pending(session: Session, attempt: Attempt, failed: tuple[Any, ...]) -> bool:
    """Every failed worker lost a peer or timed out in a collective, just now, and a node still runs:
    usually the consequence of another rank's failure, whose report may be a moment behind. Give it
    that moment, so that the rank that failed first is blamed, not its peers. A part still running
    resends its status every interval (apply_status asks settle again while a failure is undecided;
    a lost node is failed by the monitor), so the decision comes."""
    still_running = session.scalar(select(func.count()).select_from(AttemptNode).where(
        AttemptNode.attempt_id == attempt.id, AttemptNode.state.in_(PART_STARTED)))
    if not still_running:
        return False
    ended = session.execute(select(func.min(Worker.ended_at), func.max(Worker.ended_at)).where(*failed)).one()
    return _recent(list(ended))


def _decide(session: Session, job: Job, attempt: Attempt) -> None:
    """Apply the verdict; the caller holds the job and attempt locks."""
    verdict = _verdict(session, attempt)
    if verdict is None:
        return
    if verdict.failure is not None:
        reason, node_id, kind = verdict.failure
        fail_attempt(session, job, attempt, reason, node_id=node_id, kind=kind, message=verdict.message)
        return
    world = attempt.num_gpus
    if verdict.all_running:
        set_attempt_state(session, attempt, "running", f"all {world} workers of attempt {attempt.number} running")
        # A worker that reported a step was running: the same report may carry both facts.
        first_step = progress.first_at(session, attempt.id)
        attempt.started_at = min(now(), first_step or now())
        if job.state == "starting":
            set_job_state(session, job, "running", f"attempt {attempt.number}: all {world} workers running")
    if verdict.succeeded:
        end_attempt(session, attempt, outcome="succeeded", reason="every worker exited with code 0")
        if job.state in JOB_ACTIVE:
            set_job_state(session, job, "succeeded", f"attempt {attempt.number} finished")
