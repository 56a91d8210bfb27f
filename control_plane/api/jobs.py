"""/v1/jobs: thin routes over services.jobs and the read views."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Response, status
from fastapi.responses import StreamingResponse

from control_plane.api.deps import PrincipalDep, RuntimeDep, SessionDep, SettingsDep, TransactionRoute
from control_plane.schemas.jobs import AttemptOut, CheckpointOut, EventPage, JobOut, JobPage, JobSubmit
from control_plane.services import events, jobs, logs, views

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], route_class=TransactionRoute)

_PROBLEM: dict[str, Any] = {"content": {"application/problem+json": {}}}
ERRORS: dict[int | str, dict[str, Any]] = {401: _PROBLEM, 404: _PROBLEM, 409: _PROBLEM, 422: _PROBLEM}


@router.post("", response_model=JobOut, status_code=status.HTTP_201_CREATED, responses=ERRORS,
             summary="Submit a job")
def submit_job(
    body: JobSubmit,
    runtime: RuntimeDep,
    response: Response,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
) -> JobOut:
    """Queue a job. A retry with the same `Idempotency-Key` returns the same job (200)."""
    job, created = jobs.submit(session, body, principal=principal.name, idempotency_key=idempotency_key,
                               max_env_bytes=settings.max_env_bytes)
    if created:
        runtime.wake_scheduler()
    else:
        response.status_code = status.HTTP_200_OK
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return views.job_out(session, job)


@router.get("", response_model=JobPage, responses=ERRORS, summary="List jobs")
def list_jobs(
    session: SessionDep,
    _: PrincipalDep,
    state: Annotated[list[str] | None, Query(description="Filter by state (repeatable).")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> JobPage:
    items, next_cursor = jobs.list_jobs(session, states=state, limit=limit, cursor=cursor)
    return JobPage(items=views.jobs_out(session, items), next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut, responses=ERRORS, summary="Get a job")
def get_job(job_id: uuid.UUID, session: SessionDep, _: PrincipalDep) -> JobOut:
    return views.job_out(session, jobs.get_job(session, job_id))


@router.post("/{job_id}/cancel", response_model=JobOut, responses=ERRORS, summary="Cancel a job")
def cancel_job(job_id: uuid.UUID, session: SessionDep, _: PrincipalDep) -> JobOut:
    """Stops every worker (TERM, then KILL after a grace period); leases are released after."""
    return views.job_out(session, jobs.cancel(session, job_id))


@router.get("/{job_id}/attempts", response_model=list[AttemptOut], responses=ERRORS)
def list_attempts(job_id: uuid.UUID, session: SessionDep, _: PrincipalDep) -> list[AttemptOut]:
    jobs.get_job(session, job_id)
    return views.attempts_out(session, job_id)


@router.get("/{job_id}/checkpoints", response_model=list[CheckpointOut], responses=ERRORS)
def list_checkpoints(job_id: uuid.UUID, session: SessionDep, _: PrincipalDep) -> list[CheckpointOut]:
    """Newest first. Only `committed` checkpoints are ever restored from."""
    jobs.get_job(session, job_id)
    return views.checkpoints_out(session, job_id)


@router.get("/{job_id}/events", response_model=EventPage, responses=ERRORS)
def list_events(
    job_id: uuid.UUID,
    session: SessionDep,
    _: PrincipalDep,
    after: Annotated[int, Query(ge=0, description="Only events with a larger id.")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventPage:
    jobs.get_job(session, job_id)
    items = events.list_events(session, job_id=job_id, after=after, limit=limit)
    return EventPage(items=[views.event_out(e) for e in items], next_after=items[-1].id if items else None)


@router.get(
    "/{job_id}/logs",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/plain": {}}}, **ERRORS},
    summary="Worker logs (text), optionally followed",
)
def get_logs(
    job_id: uuid.UUID,
    runtime: RuntimeDep,
    session: SessionDep,
    settings: SettingsDep,
    _: PrincipalDep,
    attempt: Annotated[int | None, Query(ge=1, description="Attempt number (default: all).")] = None,
    node_rank: Annotated[int | None, Query(ge=0)] = None,
    rank: Annotated[int | None, Query(ge=0, description="Global worker rank.")] = None,
    stream: Annotated[str | None, Query(pattern="^(stdout|stderr)$")] = None,
    follow: Annotated[bool, Query(description="Keep streaming until the job ends.")] = False,
    prefix: Annotated[bool, Query(description="Prefix lines with [attempt node rank].")] = True,
) -> StreamingResponse:
    jobs.get_job(session, job_id)
    text = logs.stream_text(runtime.session_factory, job_id, attempt_number=attempt, node_rank=node_rank, rank=rank,
                            stream=stream, prefix=prefix, follow=follow, poll_s=settings.log_follow_poll_s)
    return StreamingResponse(text, media_type="text/plain; charset=utf-8")
