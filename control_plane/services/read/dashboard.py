"""Read models of the dashboard's pages (control_plane/api/ui.py): what each page shows, with the
API's own visibility rules (a member or viewer sees its tenant's jobs only)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from control_plane.authz import Principal
from control_plane.clock import now
from control_plane.models import Job, LogChunk
from control_plane.schemas.jobs import AttemptOut, CheckpointOut, EventOut, JobOut, ProgressSampleOut
from control_plane.schemas.nodes import NodeOut
from control_plane.services import events
from control_plane.services.cluster import nodes
from control_plane.services.read import views
from control_plane.services.runs import jobs, logs, progress
from control_plane.services.states import JOB_TERMINAL
from control_plane.ui.charts import line_chart

ACTIVE = ("queued", "starting", "running", "recovering", "cancelling")
LOG_TAIL_CHUNKS = 200
"""How many log chunks a job page shows when it opens (then it follows new ones)."""


def job_list(session: Session, principal: Principal, *, ended: bool, limit: int = 100) -> list[JobOut]:
    states = None if ended else list(ACTIVE)
    items, _ = jobs.list_jobs(session, states=states, limit=limit, cursor=None, tenant=principal.tenant_filter)
    return views.jobs_out(session, items)


@dataclass
class JobPage:
    job: JobOut
    attempts: list[AttemptOut]
    checkpoints: list[CheckpointOut]
    samples: list[ProgressSampleOut]
    events: list[EventOut]
    chart: str
    ended: bool


def job_page(session: Session, principal: Principal, job_id: uuid.UUID,
             budgets: Mapping[str, float | None] | None = None) -> JobPage:
    job = jobs.get_visible_job(session, job_id, principal)
    out = views.job_out(session, job)
    attempts = views.attempts_out(session, job.id, budgets)[-50:]
    checkpoints = views.checkpoints_page(session, job.id, limit=10, cursor=None).items
    rows = progress.chart_samples(session, job.id)
    samples = [ProgressSampleOut(attempt_number=r.attempt_number, step=r.step, loss=r.loss,
                                 steps_per_s=r.steps_per_s, metrics=dict(r.metrics or {}), at=r.at) for r in rows]
    recent = [views.event_out(e) for e in events.recent_events(session, job.id, 30)]
    return JobPage(job=out, attempts=attempts, checkpoints=checkpoints, samples=samples, events=recent,
                   chart=progress_chart(samples), ended=job.state in JOB_TERMINAL)


def progress_chart(samples: list[ProgressSampleOut]) -> str:
    """Loss (left axis) and step rate (right axis) over steps; a dashed line where each later attempt
    started (a recovery)."""
    loss = [(float(s.step), s.loss) for s in samples if s.loss is not None]
    rate = [(float(s.step), s.steps_per_s) for s in samples if s.steps_per_s is not None]
    starts: dict[int, float] = {}
    for s in samples:
        starts.setdefault(s.attempt_number, float(s.step))
    boundaries = [(step, f"attempt {n}") for n, step in sorted(starts.items())[1:]]
    return line_chart([("loss", loss), ("steps/s", rate)], boundaries=boundaries,  # type: ignore[list-item]
                      from_zero=("steps/s",))


@dataclass
class LogTail:
    lines: list[str] = field(default_factory=list)
    after: int = 0
    """The id of the last chunk shown: the next poll asks for chunks after it."""


def log_tail(session: Session, principal: Principal, job_id: uuid.UUID, *, after: int) -> LogTail:
    jobs.get_visible_job(session, job_id, principal)
    if after == 0:  # a page that opens shows the end of the log, then follows it
        ids = select(LogChunk.id).where(LogChunk.job_id == job_id).order_by(LogChunk.id.desc()).limit(LOG_TAIL_CHUNKS)
        after = max((session.scalar(select(func.min(ids.subquery().c.id))) or 1) - 1, 0)
    chunks = logs.read(session, job_id, after=after, limit=500)
    text = "".join(logs.format_chunk(c, n) for c, n in chunks)
    return LogTail(lines=text.splitlines(), after=chunks[-1][0].id if chunks else after)


@dataclass
class GpuCell:
    index: int
    job_id: str | None
    job_name: str | None
    hue: int | None


@dataclass
class NodeRow:
    node: NodeOut
    gpus: list[GpuCell]
    heartbeat_age_s: float | None


def node_grid(session: Session) -> list[NodeRow]:
    """Every node with its GPUs: who holds each (job name), cordon state, health."""
    out = views.node_out(session, nodes.list_nodes(session))
    held = {g.job_id for n in out for g in n.gpus if g.job_id}
    names = dict(session.execute(select(Job.id, Job.name).where(Job.id.in_([uuid.UUID(j) for j in held]))).all()) \
        if held else {}
    t = now()
    rows = []
    for n in out:
        cells = [GpuCell(g.index, g.job_id, names.get(uuid.UUID(g.job_id)) if g.job_id else None,
                         _hue(g.job_id) if g.job_id else None) for g in n.gpus]
        age = (t - n.last_heartbeat_at).total_seconds() if n.last_heartbeat_at else None
        rows.append(NodeRow(node=n, gpus=cells, heartbeat_age_s=age))
    return rows


def _hue(job_id: str) -> int:
    return int(uuid.UUID(job_id).hex[:4], 16) % 360

