"""Time limits: an attempt that outlives its job's ``time_limit_s`` is stopped and the job fails.

The limit counts from the attempt's allocation (``attempts.created_at``): the scheduler computes a
reservation's earliest start from the same instant (scheduler/allocate.py), so backfill placed on
the strength of a time limit is gone by then. The job fails without recovery: running again would
only hit the same limit.
"""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import Interval, literal_column, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.models import Attempt, Job
from control_plane.services.runs.attempts import end_attempt
from control_plane.services.states import ATTEMPT_LIVE, JOB_ACTIVE, set_job_state

ONE_SECOND = literal_column("interval '1 second'", Interval)


def enforce_time_limits(session: Session, *, at: datetime | None = None, batch: int = 500) -> list[uuid.UUID]:
    """Stop every live attempt past its job's time limit (in the caller's transaction); returns the
    jobs failed. Claims rows with SKIP LOCKED, so replicas running this at once share the work."""
    t = at or now()
    rows = session.execute(
        select(Attempt, Job)
        .join(Job, Job.id == Attempt.job_id)
        .where(
            Attempt.state.in_(ATTEMPT_LIVE),
            Attempt.outcome.is_(None),
            Job.time_limit_s.is_not(None),
            Attempt.created_at + Job.time_limit_s * ONE_SECOND <= t,
        )
        .order_by(Attempt.created_at)
        .limit(batch)
        .with_for_update(of=(Attempt, Job), key_share=True, skip_locked=True)
    ).all()
    failed = []
    for attempt, job in rows:
        reason = f"time limit of {job.time_limit_s}s exceeded"
        if not end_attempt(session, attempt, outcome="failed", reason=reason):
            continue
        attempt.failure_kind = "time_limit"
        if job.state in JOB_ACTIVE:
            set_job_state(session, job, "failed", reason, attempt_id=str(attempt.id))
            failed.append(job.id)
    return failed
