"""/v1/jobs: thin routes over services.runs.jobs and the read views. Members and viewers see their own
tenant's jobs only; another tenant's job is 404 to them (control_plane/authz.py)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.responses import StreamingResponse
from pydantic import StringConstraints

from control_plane.api.deps import (
    JobsCancel,
    JobsRead,
    JobsSubmit,
    RuntimeDep,
    SessionDep,
    SettingsDep,
    TransactionRoute,
)
from control_plane.schemas.jobs import (
    AttemptPage,
    CheckpointPage,
    EventPage,
    JobOut,
    JobPage,
    JobSubmit,
    ProgressPage,
)
from control_plane.schemas.limits import INT32_MAX, INT64_MAX
from control_plane.schemas.tenants import TENANT_NAME
from control_plane.services.read import views
from control_plane.services.runs import jobs, logs

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=TransactionRoute)

_PROBLEM: dict[str, Any] = {"content": {"application/problem+json": {}}}
ERRORS: dict[int | str, dict[str, Any]] = {401: _PROBLEM, 403: _PROBLEM, 404: _PROBLEM, 409: _PROBLEM,
                                           413: _PROBLEM, 422: _PROBLEM, 429: _PROBLEM}

Limit = Annotated[int, Query(ge=1, le=500, description="Items per page, 1 to 500.")]
Cursor = Annotated[str | None, Query(min_length=1, max_length=512, description="`next_cursor` of the page before.")]


@router.post("", response_model=JobOut, status_code=status.HTTP_201_CREATED, summary="Submit a job", responses={
    200: {"model": JobOut, "description": "A retry with the same `Idempotency-Key` and body: the job it created."},
    201: {"description": "The job, queued."}, **ERRORS})
def submit_job(
    body: JobSubmit,
    runtime: RuntimeDep,
    response: Response,
    session: SessionDep,
    settings: SettingsDep,
    principal: JobsSubmit,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", min_length=1, max_length=255,
                                                  pattern=r"^[\x21-\x7e]+$")] = None,
) -> JobOut:
    """Queue a job for the caller's tenant. A retry with the same `Idempotency-Key` returns the same
    job (200). More than the principal's submit rate is 429 with Retry-After. A job with a `model`
    block is planned first: 422 with the numbers when its layout does not fit in GPU memory; a
    `job.plan_warning` event when fewer GPUs would give more tokens/s, or more per GPU."""
    rate = jobs.SubmitRate(settings.submit_rate_per_window, settings.submit_rate_window_s)
    job, created = jobs.submit(session, body, principal=principal, idempotency_key=idempotency_key, rate=rate,
                               store=runtime.object_store, max_env_bytes=settings.max_env_bytes,
                               plan_min_efficiency=settings.plan_min_efficiency)
    if created:
        runtime.wake_scheduler()
    else:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return views.job_out(session, job)


@router.get("", response_model=JobPage, responses=ERRORS, summary="List jobs")
def list_jobs(
    session: SessionDep,
    principal: JobsRead,
    state: Annotated[list[str] | None, Query(max_length=16, description="Filter by state (repeatable).")] = None,
    name: Annotated[str | None, Query(min_length=1, max_length=128, description="Only jobs of this name.")] = None,
    tenant: Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=TENANT_NAME)]] | None,
                      Query(max_length=64, description="Only these tenants' jobs (repeatable).")] = None,
    limit: Annotated[int, Query(ge=1, le=500, description="Jobs per page, 1 to 500.")] = 50,
    cursor: Cursor = None,
) -> JobPage:
    """Newest first."""
    items, next_cursor = jobs.list_jobs(session, states=state, limit=limit, cursor=cursor,
                                        tenant=principal.tenant_filter, name=name, tenants=tenant)
    return JobPage(items=views.jobs_out(session, items), next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS, summary="Get a job")
def get_job(job_id: uuid.UUID, session: SessionDep, principal: JobsRead) -> JobOut:
    return views.job_out(session, jobs.get_visible_job(session, job_id, principal))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS, summary="Cancel a job")
def cancel_job(job_id: uuid.UUID, session: SessionDep, principal: JobsCancel) -> JobOut:
    """Stops every worker (TERM, then KILL after a grace period); leases are released after."""
    return views.job_out(session, jobs.cancel(session, job_id, principal))


@router.get("/{job_id}/attempts", response_model=AttemptPage, responses=ERRORS, summary="A job's attempts")
def list_attempts(job_id: uuid.UUID, session: SessionDep, principal: JobsRead, settings: SettingsDep,
                  limit: Limit = 100, cursor: Cursor = None) -> AttemptPage:
    """Oldest first, `limit` at a time; each recovery phase by phase, against its budget."""
    jobs.get_visible_job(session, job_id, principal)
    return views.attempts_page(session, job_id, limit=limit, cursor=cursor, budgets=settings.recovery_budgets)


@router.get("/{job_id}/checkpoints", response_model=CheckpointPage, responses=ERRORS, summary="A job's checkpoints")
def list_checkpoints(job_id: uuid.UUID, session: SessionDep, principal: JobsRead, limit: Limit = 100,
                     cursor: Cursor = None) -> CheckpointPage:
    """Newest first, `limit` at a time. Only `committed` checkpoints are ever restored from."""
    jobs.get_visible_job(session, job_id, principal)
    return views.checkpoints_page(session, job_id, limit=limit, cursor=cursor)


@router.get("/{job_id}/events", response_model=EventPage, responses=ERRORS, summary="A job's events")
def list_events(
    job_id: uuid.UUID,
    session: SessionDep,
    principal: JobsRead,
    after: Annotated[int, Query(ge=0, le=INT64_MAX, description="Only events with a larger id (to follow "
                                "the log: the last id seen).")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000, description="Events per page, 1 to 1,000.")] = 100,
    cursor: Cursor = None,
) -> EventPage:
    """Oldest first, `limit` at a time."""
    jobs.get_visible_job(session, job_id, principal)
    return views.events_page(session, job_id, after=after, limit=limit, cursor=cursor)


@router.get("/{job_id}/progress", response_model=ProgressPage, responses=ERRORS, summary="A job's progress history")
def list_progress(job_id: uuid.UUID, session: SessionDep, principal: JobsRead,
                  limit: Annotated[int, Query(ge=1, le=5000, description="Points per page, 1 to 5,000.")] = 1000,
                  cursor: Cursor = None) -> ProgressPage:
    """Oldest first: step, loss, step rate and metrics, sampled every few seconds of each attempt."""
    jobs.get_visible_job(session, job_id, principal)
    return views.progress_page(session, job_id, limit=limit, cursor=cursor)


@router.get(
    "/{job_id}/logs",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/plain": {}}}, **ERRORS},
    summary="Worker logs (text), optionally followed",
)
def get_logs(
    job_id: uuid.UUID,
    request: Request,
    runtime: RuntimeDep,
    session: SessionDep,
    settings: SettingsDep,
    principal: JobsRead,
    attempt: Annotated[int | None, Query(ge=1, le=INT32_MAX, description="Attempt number (default: all).")] = None,
    node_rank: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Node rank (default: all).")] = None,
    rank: Annotated[int | None, Query(ge=0, le=INT32_MAX, description="Global worker rank.")] = None,
    stream: Annotated[str | None, Query(pattern="^(stdout|stderr)$")] = None,
    follow: Annotated[bool, Query(description="Keep streaming until the job ends (429 past the principal's "
                                              "followers on this replica).")] = False,
    prefix: Annotated[bool, Query(description="Prefix lines with [attempt node rank].")] = True,
) -> StreamingResponse:
    jobs.get_visible_job(session, job_id, principal)
    query = logs.LogQuery(job_id, attempt_number=attempt, node_rank=node_rank, rank=rank, stream=stream,
                          prefix=prefix)
    text = logs.open_stream(runtime.session_factory, query, follow=follow, poll_s=settings.log_follow_poll_s,
                            disconnected=request.is_disconnected, followers=runtime.log_followers,
                            principal=principal.name)
    return StreamingResponse(text, media_type="text/plain; charset=utf-8")
