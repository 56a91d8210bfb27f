"""Attempts: one run of a job on a gang of GPUs, owned by a fencing token.

An attempt is ``starting`` -> ``running`` -> ``stopping`` -> ``ended``. It is decided (outcome
set, nodes told to stop) in ``end_attempt``; it is over (``ended``) only when every node has
confirmed that its processes are gone and its leases are released. Reports are fenced: only the
job's current attempt, with the right token, can change anything, and merges are monotonic, so a
duplicated or late report never moves a state backwards. See docs/architecture.md.
"""

from __future__ import annotations

import math
import secrets
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, Protocol

from sqlalchemy import func, insert, select, update
from sqlalchemy.orm import Session

from control_plane import wakeups
from control_plane.clock import now
from control_plane.db import reload, rowcount
from control_plane.errors import Forbidden
from control_plane.models import Attempt, AttemptNode, Gpu, GpuLease, Job, Node, Worker
from control_plane.services import events
from control_plane.services.checkpoints import restore_plan
from control_plane.services.fencing import authorize_report, check_own_ranks, check_worker_block, lock_attempt
from control_plane.services.states import (
    ATTEMPT_LIVE,
    JOB_ACTIVE,
    JOB_TERMINAL,
    NODE_UNREACHABLE,
    PART_DONE,
    PART_ORDER,
    PART_UNLAUNCHED,
    advance_part,
    set_attempt_state,
    set_job_state,
)
from trainyard.protocol.agent import AttemptStatusReport

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


def create_attempt(session: Session, job: Job, placement: NodePlacement, *, rdzv_port: int) -> Attempt:
    """Create the attempt, its per-node parts and every GPU lease, in the caller's transaction.

    The database refuses a lease on a GPU that is already leased, and refuses at commit an
    attempt whose leases do not cover its whole gang.
    """
    (attempt_id,) = create_attempts(session, [(job, placement, rdzv_port)])
    attempt = session.get(Attempt, attempt_id)
    assert attempt is not None
    return attempt


def create_attempts(session: Session, allocations: Sequence[tuple[Job, NodePlacement, int]]) -> list[uuid.UUID]:
    """``create_attempt`` for many (job, placement, rendezvous port) at once: a scheduling pass may
    admit hundreds of gangs, so attempts, parts and leases go in as three bulk INSERTs. The jobs
    must be locked by the caller and waiting; each moves to ``starting``. Returns the attempt ids.
    """
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
    gpu_ids = {
        (node_id, index): gpu_id
        for gpu_id, node_id, index in session.execute(
            select(Gpu.id, Gpu.node_id, Gpu.index).where(Gpu.node_id.in_(node_ids))
        )
    }
    t = now()
    attempt_rows: list[dict[str, Any]] = []
    part_rows: list[dict[str, Any]] = []
    lease_rows: list[dict[str, Any]] = []
    for job, placement, port in allocations:
        attempt_id = uuid.uuid4()
        earlier = last.get(job.id)
        attempt_rows.append({
            "id": attempt_id, "job_id": job.id, "number": (earlier or 0) + 1,
            "fencing_token": secrets.token_hex(24), "state": "starting", "num_gpus": job.num_gpus,
            "rdzv_host": placement[0][0].address, "rdzv_port": port, "created_at": t,
            # Only a job that ran before can have checkpoints to restore from.
            "restore_manifest": restore_plan(session, job) if earlier else None,
        })
        for node_rank, (node, indices) in enumerate(placement):
            part_rows.append({
                "id": uuid.uuid4(), "attempt_id": attempt_id, "node_id": node.id, "node_rank": node_rank,
                "gpu_indices": list(indices), "desired": "run", "state": "assigned",
            })
            lease_rows += [
                {"id": uuid.uuid4(), "gpu_id": gpu_ids[(node.id, index)], "node_id": node.id,
                 "attempt_id": attempt_id, "job_id": job.id, "created_at": t}
                for index in indices
            ]
    session.execute(insert(Attempt), attempt_rows)
    session.execute(insert(AttemptNode), part_rows)
    wakeups.notify_nodes(session, {row["node_id"] for row in part_rows})  # wake their long polls
    session.execute(insert(GpuLease), lease_rows)
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
        )
        events.record(
            session,
            "attempt.allocated",
            f"attempt {number} gang-allocated",
            job_id=job.id,
            attempt_id=attempt_id,
            placement=layout,
            rendezvous=f"{row['rdzv_host']}:{port}",
        )
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
    session: Session, job: Job, attempt: Attempt, reason: str, *, node_id: uuid.UUID | None = None
) -> None:
    """End a failed attempt, count the failure, and move the job on (recover or fail).

    ``node_id`` is the node blamed for the failure (its worker died first, its torchrun failed, or
    it was lost): a node blamed twice by one job is avoided for that job (scheduler/allocate.py).
    """
    if not end_attempt(session, attempt, outcome="failed", reason=reason):
        return
    attempt.failed_node_id = node_id
    if job.state in JOB_TERMINAL or job.state == "cancelling":
        return
    job.failures = (job.failures or 0) + 1
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
            node_id=part.node_id,
        )
        failed.append(attempt_id)
    return failed


def release_part(session: Session, part: AttemptNode) -> None:
    """A node confirmed its processes of this attempt are gone: release its leases."""
    locked = lock_attempt(session, part.attempt_id)
    assert locked is not None
    job, attempt = locked
    part = reload(session, select(AttemptNode).where(AttemptNode.id == part.id).with_for_update(key_share=True)).one()
    if part.released_at is not None:
        return
    t = now()
    part.released_at = t
    advance_part(session, part, "gone", job_id=attempt.job_id)
    session.info["released"] = session.info.get("released", 0) + 1  # lets the caller wake the scheduler
    released = rowcount(session.execute(
        update(GpuLease)
        .where(
            GpuLease.attempt_id == part.attempt_id,
            GpuLease.node_id == part.node_id,
            GpuLease.released_at.is_(None),
        )
        .values(released_at=t)
    ))
    events.record(
        session,
        "leases.released",
        f"node rank {part.node_rank} stopped; {released} GPU leases released",
        job_id=attempt.job_id,
        attempt_id=attempt.id,
        node_id=part.node_id,
    )
    finish_if_released(session, job, attempt)


def finish_if_released(session: Session, job: Job, attempt: Attempt) -> None:
    """Mark the attempt ended once every node released; finish a cancelling job.

    A cancelling job does not wait for a lost node: it is ``cancelled`` once every part is released
    or on a lost (or removed) node. That node's leases stay held, shown in the node view, until it
    returns and confirms or an operator removes it; only then does the attempt end.

    The caller holds the job and attempt locks (lock_attempt), so a release that committed before
    is seen here: two nodes releasing at once cannot both conclude that the other has not."""
    if attempt.outcome is None:
        return
    session.flush()
    # A count, not the parts: each of a 128-node gang's releases runs this under the job lock.
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


def progress_metrics(metrics: Mapping[str, float]) -> dict[str, float] | None:
    """What is stored of a report's metrics: the wire contract bounds them (at most MAX_METRICS
    finite values under short names, trainyard/protocol/limits.py); JSONB holds no NaN or
    infinity, so a non-finite value that got past it is dropped rather than failing the report."""
    return {name: float(value) for name, value in sorted(metrics.items()) if math.isfinite(value)} or None


def apply_status(
    session: Session, node: Node, attempt_id: uuid.UUID, report: AttemptStatusReport
) -> tuple[Attempt, AttemptNode]:
    """Merge a node's level-triggered status report into the attempt; decide its outcome."""
    job, attempt, part = authorize_report(session, node, attempt_id, report.fencing_token, report.node_rank)
    t = now()
    part.reported_at = t
    if advance_part(session, part, report.state.value, job_id=job.id) and report.exit_code is not None:
        part.exit_code = report.exit_code
    if report.error and not part.error:
        part.error = report.error
    _merge_workers(session, attempt, part, report)
    # Progress only moves forward within an attempt; the job shows its current attempt's, which
    # after a recovery starts again from the restored step.
    if report.progress is not None and (attempt.progress_step is None or report.progress.step >= attempt.progress_step):
        attempt.progress_step = report.progress.step
        job.progress_step = report.progress.step
        job.progress_loss = report.progress.loss
        job.progress_at = report.progress.at
        attempt.progress_metrics = progress_metrics(report.progress.metrics)
        if attempt.first_progress_at is None:
            attempt.first_progress_at = t
    # Global rank 0 reports the result. The agent pins torchrun's node order (node_agent/launcher.py)
    # so it runs on node rank 0, but another launcher may put it elsewhere: the part that holds
    # worker rank 0 (as reported, checked by _merge_workers) is the one.
    if report.result is not None and job.result is None:
        if not _holds_rank_zero(session, part):
            raise Forbidden(f"node rank {part.node_rank} does not run global rank 0: only that node reports the "
                            "job's result")
        job.result = report.result
    session.flush()
    if attempt.outcome is None:
        _decide(session, job, attempt)
    return attempt, part


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


def _decide(session: Session, job: Job, attempt: Attempt) -> None:
    parts = session.scalars(
        select(AttemptNode).where(AttemptNode.attempt_id == attempt.id).order_by(AttemptNode.node_rank)
    ).all()
    workers = session.scalars(select(Worker).where(Worker.attempt_id == attempt.id)).all()
    names = {n.id: n.name for n in session.scalars(select(Node).where(Node.id.in_([p.node_id for p in parts])))}
    rank_node = {p.id: p for p in parts}
    failed = [w for w in workers if w.state == "exited" and w.exit_code not in (0, None)]
    if failed:
        first = min(failed, key=lambda w: (w.ended_at or now(), w.rank))
        part = rank_node[first.attempt_node_id]
        fail_attempt(
            session,
            job,
            attempt,
            f"rank {first.rank} on {names[part.node_id]} exited with code {first.exit_code}",
            node_id=part.node_id,
        )
        return
    for p in parts:
        if p.error or (p.state in PART_DONE and p.exit_code not in (0, None)):
            detail = p.error or f"torchrun exited with code {p.exit_code}"
            fail_attempt(session, job, attempt, f"node rank {p.node_rank} on {names[p.node_id]}: {detail}",
                         node_id=p.node_id)
            return
    world = attempt.num_gpus
    running = sum(1 for w in workers if w.state in ("running", "exited"))
    if attempt.state == "starting" and running >= world:
        set_attempt_state(session, attempt, "running", f"all {world} workers of attempt {attempt.number} running")
        # A worker that reported a step was running: the same report may carry both facts.
        attempt.started_at = min(now(), attempt.first_progress_at or now())
        if job.state == "starting":
            set_job_state(session, job, "running", f"attempt {attempt.number}: all {world} workers running")
    # A node part may already be "gone" (released) when the last node's exit report arrives.
    if all(p.state in ("exited", "gone") and p.exit_code == 0 for p in parts):
        end_attempt(session, attempt, outcome="succeeded", reason="every worker exited with code 0")
        if job.state in JOB_ACTIVE:
            set_job_state(session, job, "succeeded", f"attempt {attempt.number} finished")


def desired_for_node(session: Session, node: Node) -> list[tuple[Attempt, AttemptNode, Job]]:
    """The attempts this node must run now (its desired state)."""
    rows = session.execute(
        select(Attempt, AttemptNode, Job)
        .join(AttemptNode, AttemptNode.attempt_id == Attempt.id)
        .join(Job, Job.id == Attempt.job_id)
        .where(
            AttemptNode.node_id == node.id,
            AttemptNode.desired == "run",
            Attempt.state.in_(ATTEMPT_LIVE),
        )
    ).all()
    return [(a, p, j) for a, p, j in rows]
