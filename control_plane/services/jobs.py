"""Jobs: submit, read, cancel, and the one function that changes a job's state."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from datetime import datetime

from sqlalchemy import and_, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import IdempotencyMismatch, InvalidState, NotFound, Unprocessable
from control_plane.models import Attempt, Gpu, Job, Node
from control_plane.schemas.jobs import JOB_STATES, JobSubmit
from control_plane.services import events
from control_plane.services.states import ATTEMPT_HOLDING, JOB, JOB_TERMINAL, can_transition, set_job_state

# The job state machine and its one mutator live in services/states.py (with those of attempts,
# attempt parts and nodes); these names stay importable from here.
TERMINAL = JOB_TERMINAL
TRANSITIONS: dict[str, frozenset[str]] = {state: spec.to for state, spec in JOB.items()}
__all__ = ["TERMINAL", "TRANSITIONS", "can_transition", "set_job_state"]


def _request_hash(body: JobSubmit) -> str:
    return hashlib.sha256(body.model_dump_json().encode()).hexdigest()


def check_fits_cluster(session: Session, body: JobSubmit) -> None:
    """Refuse a job that no registered cluster layout could ever hold: a gang runs on nodes of one
    GPU kind, so some kind it accepts must have enough nodes that are large enough."""
    kinds = body.gpu_kinds()
    stmt = (
        select(Node.id, func.min(Gpu.kind), func.count(Gpu.id))
        .join(Gpu, Gpu.node_id == Node.id)
        .where(Node.state != "removed")
        .group_by(Node.id)
    )
    if kinds:
        stmt = stmt.where(Gpu.kind.in_(kinds))
    by_kind: dict[str, list[int]] = {}
    for _, kind, count in session.execute(stmt):
        by_kind.setdefault(kind, []).append(count)
    named = f" of kind {' or '.join(repr(k) for k in kinds)}" if kinds else ""
    if not by_kind:
        raise Unprocessable(f"no nodes with GPUs{named} are registered, so this job can never be placed"
                            if kinds else "no nodes are registered, so this job can never be placed")
    biggest = max(n for counts in by_kind.values() for n in counts)
    if body.gpus_per_node > biggest:
        raise Unprocessable(
            f"gpus_per_node={body.gpus_per_node} is larger than any node{named}: the largest has {biggest} GPUs",
            field="gpus_per_node",
        )
    fitting = max(sum(1 for n in counts if n >= body.gpus_per_node) for counts in by_kind.values())
    if fitting < body.num_nodes:
        of_one = " of one GPU kind" if len(by_kind) > 1 else ""
        raise Unprocessable(
            f"the job needs {body.num_nodes} nodes{of_one} with at least {body.gpus_per_node} GPUs each; "
            f"the cluster has {fitting} such nodes{named}",
            field="num_nodes",
        )


def submit(
    session: Session, body: JobSubmit, *, principal: str, idempotency_key: str | None
) -> tuple[Job, bool]:
    """Create a queued job. Returns (job, created); a retried submit returns the first job."""
    digest = _request_hash(body)
    if idempotency_key:
        existing = session.scalar(
            select(Job).where(Job.principal == principal, Job.idempotency_key == idempotency_key)
        )
        if existing is not None:
            return _same_request(existing, digest), False
    from control_plane.services.tenants import check_quota  # tenants imports this module

    check_fits_cluster(session, body)
    check_quota(session, body.tenant, body.num_nodes * body.gpus_per_node)
    job = Job(
        id=uuid.uuid4(),
        name=body.name,
        principal=principal,
        tenant=body.tenant,
        priority=body.priority,
        state="queued",
        num_nodes=body.num_nodes,
        gpus_per_node=body.gpus_per_node,
        gpu_kinds=body.gpu_kinds(),
        entrypoint=body.entrypoint,
        args=body.args,
        env=body.env,
        checkpoint=body.checkpoint.model_dump(),
        max_failures=body.max_failures,
        failures=0,
        time_limit_s=body.time_limit_s,
        idempotency_key=idempotency_key,
        request_hash=digest,
        created_at=now(),
        updated_at=now(),
    )
    session.add(job)
    session.flush()
    events.record(
        session,
        "job.queued",
        f"job {body.name} submitted: {body.num_nodes} x {body.gpus_per_node} GPUs",
        job_id=job.id,
        principal=principal,
    )
    try:
        session.commit()
    except IntegrityError:
        # A concurrent retry with the same key won the race: return its job.
        session.rollback()
        existing = session.scalar(
            select(Job).where(Job.principal == principal, Job.idempotency_key == idempotency_key)
        )
        if existing is None:
            raise
        return _same_request(existing, digest), False
    return job, True


def _same_request(job: Job, digest: str) -> Job:
    if job.request_hash != digest:
        raise IdempotencyMismatch(
            "this Idempotency-Key was already used for a different job request; use a new key",
            job_id=str(job.id),
        )
    return job


def get_job(session: Session, job_id: uuid.UUID, *, for_update: bool = False) -> Job:
    stmt = select(Job).where(Job.id == job_id)
    if for_update:
        stmt = stmt.with_for_update(key_share=True).execution_options(populate_existing=True)
    job = session.scalar(stmt)
    if job is None:
        raise NotFound(f"job {job_id} does not exist")
    return job


def _encode_cursor(job: Job) -> str:
    raw = json.dumps([job.created_at.isoformat(), str(job.id)]).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, uuid.UUID]:
    try:
        created, jid = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        return datetime.fromisoformat(created), uuid.UUID(jid)
    except Exception as exc:
        raise Unprocessable("cursor is not one this API returned", field="cursor") from exc


def list_jobs(
    session: Session, *, states: list[str] | None, limit: int, cursor: str | None
) -> tuple[list[Job], str | None]:
    """Newest first, keyset-paginated."""
    for s in states or []:
        if s not in JOB_STATES:
            raise Unprocessable(f"unknown state {s!r}; expected one of {', '.join(JOB_STATES)}", field="state")
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    if states:
        stmt = stmt.where(Job.state.in_(states))
    if cursor:
        created, jid = _decode_cursor(cursor)
        stmt = stmt.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < jid)))
    jobs = list(session.scalars(stmt))
    next_cursor = _encode_cursor(jobs[limit - 1]) if len(jobs) > limit else None
    return jobs[:limit], next_cursor


def cancel(session: Session, job_id: uuid.UUID) -> Job:
    """Cancel a job: at once if nothing runs, else stop every process first (cancelling)."""
    from control_plane.services import attempts  # attempts imports this module

    job = get_job(session, job_id, for_update=True)
    if job.state in TERMINAL:
        raise InvalidState(f"job {job.id} already ended ({job.state}); there is nothing to cancel")
    if job.state == "cancelling":
        return job
    attempt = (session.get(Attempt, job.current_attempt_id, with_for_update={"key_share": True}, populate_existing=True)
               if job.current_attempt_id else None)
    if attempt is not None and attempt.state in ATTEMPT_HOLDING:
        attempts.end_attempt(session, attempt, outcome="cancelled", reason="cancelled by user")
        set_job_state(session, job, "cancelling", "cancel requested; stopping every worker")
        attempts.finish_if_released(session, job, attempt)
    else:
        set_job_state(session, job, "cancelled", "cancelled by user")
    session.commit()
    return job
