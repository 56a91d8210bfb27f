"""Jobs: submit, read, cancel, and the one function that changes a job's state."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane import authz
from control_plane.authz import Principal
from control_plane.clock import now
from control_plane.errors import Forbidden, IdempotencyMismatch, InvalidState, NotFound, TooMany, Unprocessable
from control_plane.models import Attempt, Gpu, Job, Node
from control_plane.schemas.jobs import JOB_STATES, JobSubmit
from control_plane.services import events, pages
from control_plane.services.cluster.tenants import check_quota, max_priority
from control_plane.services.read import plans
from control_plane.services.runs import attempts, code
from control_plane.services.states import ATTEMPT_HOLDING, JOB, JOB_TERMINAL, can_transition, set_job_state
from trainyard.protocol.env import job_env_bytes
from trainyard.protocol.layout import Layout

# The job state machine and its one mutator live in services/states.py (with those of attempts,
# attempt parts and nodes); these names stay importable from here.
TERMINAL = JOB_TERMINAL
TRANSITIONS: dict[str, frozenset[str]] = {state: spec.to for state, spec in JOB.items()}
__all__ = ["TERMINAL", "TRANSITIONS", "can_transition", "set_job_state"]


def _request_hash(body: JobSubmit) -> str:
    """What an Idempotency-Key is bound to: the request's meaning, so a field left at its default
    equals a field not sent, and a field a later release adds (with its default) leaves the hash of
    every earlier request as it was: a retry across an upgrade is still the same request."""
    return hashlib.sha256(body.model_dump_json(exclude_defaults=True).encode()).hexdigest()


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


def check_env_size(body: JobSubmit, max_env_bytes: int | None) -> None:
    """Refuse an env over this server's ``max_env_bytes`` (the schema holds the protocol's cap)."""
    size = job_env_bytes(body.env)
    if max_env_bytes is not None and size > max_env_bytes:
        raise Unprocessable(f"env is {size} bytes; this server allows at most {max_env_bytes}", field="env")


def submit(
    session: Session, body: JobSubmit, *, principal: Principal, idempotency_key: str | None,
    rate: SubmitRate | None = None, plan_min_efficiency: float = 0.7, max_env_bytes: int | None = None,
    store: Any = None,
) -> tuple[Job, bool]:
    """Create a queued job for the principal's tenant (an admin may name another). Returns (job,
    created); a retried submit returns the first job. A job with a model block is planned first
    (services/read/plans.py): refused when its layout does not fit, queued with a warning event for each
    way fewer GPUs would do better. Shipped code must have been uploaded for the job's tenant: checked
    in the object ``store`` first, before any transaction."""
    check_env_size(body, max_env_bytes)
    shipped = None
    if body.code is not None:
        try:
            shipped = code.for_job(store, authz.submit_tenant(principal, body.tenant), body.code.sha256)
        except ValueError as exc:
            raise Forbidden(str(exc)) from exc
    digest = _request_hash(body)
    if idempotency_key is not None:
        existing = session.scalar(
            select(Job).where(Job.principal == principal.name, Job.idempotency_key == idempotency_key)
        )
        if existing is not None:
            return _same_request(existing, digest), False

    try:
        tenant = authz.submit_tenant(principal, body.tenant)
        authz.check_priority(principal, body.priority, max_priority(session, tenant), tenant)
    except ValueError as exc:
        raise Forbidden(str(exc)) from exc
    if rate is not None and not principal.is_admin:
        check_submit_rate(session, principal.name, rate)
    check_fits_cluster(session, body)
    check_quota(session, tenant, body.num_nodes * body.gpus_per_node)
    job_plan = None
    if body.model is not None:
        job_plan = plans.plan_for_job(
            session, model=body.model, layout=body.layout or Layout(),
            gpu_kind=plans.job_gpu_kind(session, body.gpu_kinds(), body.gpus_per_node), num_nodes=body.num_nodes,
            gpus_per_node=body.gpus_per_node, min_efficiency=plan_min_efficiency)
    job = Job(
        id=uuid.uuid4(),
        name=body.name,
        principal=principal.name,
        tenant=tenant,
        priority=body.priority,
        state="queued",
        num_nodes=body.num_nodes,
        gpus_per_node=body.gpus_per_node,
        gpu_kinds=body.gpu_kinds(),
        entrypoint=body.entrypoint or "",  # '' for a command job (the column is not null)
        args=body.args,
        command=body.command,
        env=body.env,
        # when_busy only when it is not the default: the stored block stays what older versions wrote.
        checkpoint=_checkpoint_block(body),
        watchdog=body.watchdog.model_dump(mode="json") if body.watchdog else None,
        max_failures=body.max_failures,
        failures=0,
        time_limit_s=body.time_limit_s,
        model=body.model.model_dump(mode="json", exclude_none=True) if body.model else None,
        layout=body.layout.model_dump(mode="json") if body.layout else None,
        plan=job_plan.model_dump(mode="json") if job_plan else None,
        code=shipped,
        python=body.python,
        requirements=body.requirements,
        restartable=body.restartable,
        retry_same_exception=body.retry_same_exception,
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
        principal=principal.name,
        tenant=tenant,
    )
    for warning in job_plan.warnings if job_plan else []:
        events.record(session, "job.plan_warning", f"job {body.name}: {warning.message}", job_id=job.id,
                      reason=warning.kind, gpus=body.num_nodes * body.gpus_per_node, better_gpus=warning.better_gpus)
    try:
        session.commit()
    except IntegrityError:
        # A concurrent retry with the same key won the race: return its job.
        session.rollback()
        existing = session.scalar(
            select(Job).where(Job.principal == principal.name, Job.idempotency_key == idempotency_key)
        )
        if existing is None:
            raise
        return _same_request(existing, digest), False
    return job, True


@dataclass(frozen=True)
class SubmitRate:
    """At most ``jobs`` submits per principal per ``window_s`` (settings.submit_rate_*)."""

    jobs: int
    window_s: float


def check_submit_rate(session: Session, principal: str, rate: SubmitRate) -> None:
    """Refuse (429) a submit past the principal's rate. Counted from the jobs table, so the limit
    holds across replicas; a transaction-scoped advisory lock per principal serializes one
    principal's concurrent submits, so a burst cannot all pass the count at once."""
    session.execute(text("SELECT pg_advisory_xact_lock(hashtextextended(:key, 0))"),
                    {"key": f"trainyard.submit:{principal}"})
    since = now() - timedelta(seconds=rate.window_s)
    recent = list(session.scalars(
        select(Job.created_at).where(Job.principal == principal, Job.created_at > since)
        .order_by(Job.created_at).limit(rate.jobs)))
    if len(recent) >= rate.jobs:
        wait = (recent[0] - since).total_seconds()
        raise TooMany(f"principal {principal} submitted {rate.jobs} jobs in the last {rate.window_s:g}s "
                      f"(settings submit_rate_per_window / submit_rate_window_s); retry in {wait:.0f}s",
                      retry_after_s=max(1.0, wait))


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


def get_visible_job(session: Session, job_id: uuid.UUID, principal: Principal, *, for_update: bool = False) -> Job:
    """The job, if the principal may see it: another tenant's job is 404 to a member or viewer, as
    one that does not exist, so that ids cannot be probed."""
    job = get_job(session, job_id, for_update=for_update)
    if not principal.can_see(job.tenant):
        raise NotFound(f"job {job_id} does not exist")
    return job


def list_jobs(
    session: Session, *, states: list[str] | None, limit: int, cursor: str | None, tenant: str | None = None,
    name: str | None = None, tenants: list[str] | None = None,
) -> tuple[list[Job], str | None]:
    """Newest first, keyset-paginated; ``tenant``: that tenant's only (the caller's visibility);
    ``name``, ``tenants``: the caller's filters."""
    for s in states or []:
        if s not in JOB_STATES:
            raise Unprocessable(f"unknown state {s!r}; expected one of {', '.join(JOB_STATES)}", field="state")
    stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    if states:
        stmt = stmt.where(Job.state.in_(states))
    if tenant is not None:
        stmt = stmt.where(Job.tenant == tenant)
    if tenants:
        stmt = stmt.where(Job.tenant.in_(tenants))
    if name is not None:
        stmt = stmt.where(Job.name == name)
    if cursor:
        created, jid = pages.decode(cursor, datetime, uuid.UUID)
        stmt = stmt.where(or_(Job.created_at < created, and_(Job.created_at == created, Job.id < jid)))
    jobs = list(session.scalars(stmt))
    last = jobs[limit - 1] if len(jobs) > limit else None
    next_cursor = pages.encode(last.created_at.isoformat(), str(last.id)) if last is not None else None
    return jobs[:limit], next_cursor


def cancel(session: Session, job_id: uuid.UUID, principal: Principal) -> Job:
    """Cancel a job: at once if nothing runs, else stop every process first (cancelling)."""

    job = get_visible_job(session, job_id, principal, for_update=True)
    if job.state in TERMINAL:
        raise InvalidState(f"job {job.id} already ended ({job.state}); there is nothing to cancel")
    if job.state == "cancelling":
        return job
    attempt = (session.get(Attempt, job.current_attempt_id, with_for_update={"key_share": True}, populate_existing=True)
               if job.current_attempt_id else None)
    if attempt is not None and attempt.state in ATTEMPT_HOLDING:
        attempts.end_attempt(session, attempt, outcome="cancelled", reason=f"cancelled by {principal.name}")
        set_job_state(session, job, "cancelling", "cancel requested; stopping every worker")
        attempts.finish_if_released(session, job, attempt)
    else:
        set_job_state(session, job, "cancelled", f"cancelled by {principal.name}")
    session.commit()
    return job


def _checkpoint_block(body: JobSubmit) -> dict[str, Any]:
    """The checkpoint block as stored: the fields added later only when set, so it stays what older
    versions wrote for the same request."""
    block = body.checkpoint.model_dump()
    if block.get("when_busy") == "wait":
        del block["when_busy"]
    if block.get("first_interval_steps") is None:
        block.pop("first_interval_steps", None)
    if block.get("memory_tier") is True:
        del block["memory_tier"]
    return block
