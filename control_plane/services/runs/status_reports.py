"""An attempt's status reports, in two phases (docs/architecture.md, "Level-triggered status and
monotonic merges" and "Lock order").

Phase 1 (``apply_status``) merges one node's report into its own part, its workers and its
progress, under shared job and attempt locks: the reports of a job's nodes never wait for each
other. Phase 2 (``settle``), after phase 1 committed, decides what the committed reports say
together (``_verdict``: a failure and the node to blame, every worker running, every node exited 0)
and publishes the job's result, under the exclusive locks; a decision ends the attempt through
attempts.py. The release a final report asks for comes last (``release_reported``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import Forbidden, InvalidState
from control_plane.models import Attempt, AttemptPart, Job, Node, Worker
from control_plane.services.locks import lock_part
from control_plane.services.runs import parking, progress
from control_plane.services.runs.attempts import end_attempt, fail_attempt, finish_if_released, release_parts
from control_plane.services.runs.fencing import authorize_report, check_own_ranks, check_worker_block, lock_attempt
from control_plane.services.states import (
    ATTEMPT_LIVE,
    JOB_ACTIVE,
    PART_DONE,
    PART_PARKED,
    PART_STARTED,
    advance_part,
    set_attempt_state,
    set_job_state,
)
from trainyard.protocol.agent import AttemptStatusReport

WORKER_ORDER = {"starting": 0, "running": 1, "exited": 2}


@dataclass(frozen=True)
class StatusMerged:
    """What merging one status report did (phase 1), and whether phase 2 may have to decide."""

    attempt: Attempt
    part: AttemptPart
    job: Job
    """Held so that the session keeps it (its identity map holds objects weakly): the answer's
    checkpoint interval reads it without another transaction (intervals.current_steps)."""
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
    # Progress only moves forward within a part; the views take the furthest part (services/runs/progress.py).
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
    return StatusMerged(attempt=attempt, part=part, job=job, released=part.released_at is not None,
                        release=release, settle=settle)


def release_reported(session: Session, part_id: uuid.UUID) -> bool:
    """The release a final status report asked for (``StatusMerged.release``), after its phases
    committed: after ``settle``, so that a verdict the report completes is taken before the part is
    given back, and the release of the gang's last part ends the attempt with it. Part of the
    caller's transaction; True once the part is released (by this call or before)."""
    release_parts(session, [part_id])
    return session.scalar(select(AttemptPart.released_at).where(AttemptPart.id == part_id)) is not None


PARKED = "parked"
"""session.info key: a report parked a part (the caller wakes the scheduler after its commit)."""


def _check_parkable(job: Job, attempt: Attempt, part: AttemptPart) -> None:
    """Only a part its agent was allowed to park (services/runs/parking.py) may be parked: any other is
    never held back from stopping (its GPUs would stay leased to workers nobody should hand
    anything to)."""
    why = parking.refusal(job, attempt, part)
    if why is not None:
        raise InvalidState(f"node rank {part.node_rank} cannot be parked: {why}")


def _mark_timings(part: AttemptPart, attempt: Attempt, report: AttemptStatusReport, t: datetime) -> None:
    """The instants the agent reports as ages (its monotonic clock), on our clock: once each. Never
    before the attempt existed: a report's own latency is the only error, and it can only make an
    instant later."""
    if report.received_s_ago is not None and part.received_at is None:
        part.received_at = max(attempt.created_at, t - timedelta(seconds=report.received_s_ago))
    if report.initialized_s_ago is not None and part.initialized_at is None:
        part.initialized_at = max(attempt.created_at, t - timedelta(seconds=report.initialized_s_ago))


def settle(session: Session, attempt_id: uuid.UUID, result: dict[str, Any] | None = None, *,
           silence: Silence | None = None) -> Attempt | None:
    """Phase 2 of a status report, after phase 1 committed: decide what the attempt's committed
    reports together say (``_verdict``), publish the job's result, end a released gang. An
    unlocked read first; the job and attempt locks only when there is something to do, and the
    verdict is taken again under them. Part of the caller's transaction; returns the attempt."""
    attempt = session.get(Attempt, attempt_id, populate_existing=True)
    if attempt is None:
        return None
    publish = result is not None and session.scalar(select(Job.result).where(Job.id == attempt.job_id)) is None
    if not publish and (attempt.outcome is not None or _verdict(session, attempt, silence) is None):
        return attempt  # a release ends a decided gang itself (release_parts)
    locked = lock_attempt(session, attempt_id)
    if locked is None:
        return attempt
    job, attempt = locked
    # Only the part holding global rank 0 got here with a result (apply_status checked it).
    if result is not None and job.result is None:
        job.result = result
    if attempt.outcome is None:
        _decide(session, job, attempt, silence)
    finish_if_released(session, job, attempt)
    return attempt


STEP_TIME_WEIGHT = 0.3
"""Weight of the newest advance in the smoothed step time (an exponential moving average)."""


def _advance(part: AttemptPart, step: int, t: datetime) -> None:
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


def _own_ranks(session: Session, part: AttemptPart, report: AttemptStatusReport) -> bool:
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


def _holds_rank_zero(session: Session, part: AttemptPart) -> bool:
    return session.scalar(select(Worker.attempt_part_id).where(Worker.attempt_id == part.attempt_id,
                                                                Worker.rank == 0)) == part.id


def _merge_workers(session: Session, attempt: Attempt, part: AttemptPart, report: AttemptStatusReport) -> None:
    """Merge the node's workers, which must be its own: one node's block of ranks, none of them
    another node's (fencing.check_own_ranks)."""
    if report.workers:
        check_worker_block([(w.rank, w.local_rank) for w in report.workers], world=attempt.num_gpus,
                           per_node=max(1, len(part.gpu_indices)))
        check_own_ranks(session, part, {w.rank for w in report.workers})
    existing = {
        w.rank: w for w in session.scalars(select(Worker).where(Worker.attempt_part_id == part.id))
    }
    for ws in report.workers:
        w = existing.get(ws.rank)
        if w is None:
            w = Worker(
                attempt_id=attempt.id,
                attempt_part_id=part.id,
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


def _part_failure(part: AttemptPart) -> str:
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


def _verdict(session: Session, attempt: Attempt, silence: Silence | None = None) -> _Verdict | None:
    """Aggregates over the attempt's parts and workers (not every row: a 1,024-rank attempt has 1,024
    workers); None when there is nothing to decide."""
    # A part stopped at one of its resource limits is the cause, whatever its workers' exits say: the
    # kernel or its agent killed them for it (a memory hog's worker reads "killed by SIGKILL").
    limited = session.execute(
        select(AttemptPart.node_rank, AttemptPart.error, AttemptPart.node_id)
        .where(AttemptPart.attempt_id == attempt.id, AttemptPart.error_kind == "resource_limit")
        .order_by(AttemptPart.node_rank).limit(1)).one_or_none()
    if limited is not None:
        name = session.scalar(select(Node.name).where(Node.id == limited.node_id))
        return _Verdict((f"node rank {limited.node_rank} on {name}: {limited.error}", limited.node_id,
                         "resource_limit"), False, False)
    failed = (Worker.attempt_id == attempt.id, Worker.state == "exited", Worker.exit_code.is_not(None),
              Worker.exit_code != 0)
    # A script that cannot start is the cause wherever it shows; then a rank's own failure before a
    # peer's collective error; then the first to die.
    first = session.execute(
        select(Worker.rank, Worker.exit_code, Worker.exit_cause, Worker.exit_message, AttemptPart.node_id)
        .join(AttemptPart, AttemptPart.id == Worker.attempt_part_id)
        .where(*failed)
        .order_by(func.coalesce(Worker.exit_cause, "") != "start_error",
                  func.coalesce(Worker.exit_cause, "") == "collective_timeout",
                  Worker.ended_at.asc().nulls_last(), Worker.rank).limit(1)
    ).one_or_none()
    if first is not None:
        if first.exit_cause == "collective_timeout":
            silent = None if silence is None else _silent_part(session, attempt, silence)
            if silent is not None:
                # Its peers lost it and its node stopped heartbeating: a node that died (its agent
                # with it), whose own report will never come. Blamed now, not after the node-lost
                # timeout, so that the next attempt is placed without it (docs/architecture.md,
                # "Recovery").
                node_rank, node_id, name, quiet_s = silent
                return _Verdict((f"node rank {node_rank} on {name} went silent ({quiet_s:.1f}s without a heartbeat) "
                                 f"when rank {first.rank} lost a peer", node_id, "node_lost"), False, False,
                                first.exit_message)
            if _consequence_pending(session, attempt, failed):
                return None
        name = session.scalar(select(Node.name).where(Node.id == first.node_id))
        plain = f"exited with code {first.exit_code}"  # a plain exit's message says no more than this
        said = f": {first.exit_message}" if first.exit_message and first.exit_message != plain else ""
        return _Verdict((f"rank {first.rank} on {name} {plain}{said}", first.node_id,
                         first.exit_cause or "exit_code"), False, False, first.exit_message)
    bad = session.execute(
        select(AttemptPart)
        .where(AttemptPart.attempt_id == attempt.id,
               or_(AttemptPart.error.is_not(None),
                   and_(AttemptPart.state.in_(PART_DONE), AttemptPart.exit_code.is_not(None),
                        AttemptPart.exit_code != 0)))
        .order_by(AttemptPart.node_rank).limit(1)
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
        select(func.count()).select_from(AttemptPart)
        .where(AttemptPart.attempt_id == attempt.id,
               or_(AttemptPart.state.not_in(("exited", "gone")), AttemptPart.exit_code.is_(None),
                   AttemptPart.exit_code != 0)))
    if not all_running and unfinished:
        return None
    return _Verdict(None, all_running, not unfinished)


def _workers_expected(session: Session, attempt: Attempt) -> int:
    """The workers an attempt's parts report: every rank under torchrun; one per node for a
    ``command`` job, whose part is its own launcher's and is reported as a whole (the node's first
    rank: node_agent/part/commands.py, command_argv)."""
    command, nodes = session.execute(select(Job.command, Job.num_nodes).where(Job.id == attempt.job_id)).one()
    return nodes if command else attempt.num_gpus


SILENT_HEARTBEATS = 2.0
"""A node whose agent has missed this many of its heartbeat intervals (beyond its heartbeats' own
measured lag) when a peer's collective failed is taken for dead (the cause) rather than waited for."""


@dataclass(frozen=True)
class Silence:
    """What the monitor loop knows of liveness that a status report does not: only it blames a
    silent node (``_silent_part``)."""

    interval_s: float
    """The configured heartbeat interval (a node told no other has NULL for its own)."""
    not_before: datetime | None = None
    """No node is silent before this (the grace after a control-plane start or a database outage)."""


def _silent_part(session: Session, attempt: Attempt, silence: Silence) -> tuple[int, uuid.UUID, str, float] | None:
    """A part of the attempt still running on a node that has not heartbeated for SILENT_HEARTBEATS
    of its intervals, its heartbeats' last measured lag aside: (node rank, node id, name, seconds
    since its last heartbeat)."""
    t = now()
    if silence.not_before is not None and t < silence.not_before:
        return None
    rows = session.execute(
        select(AttemptPart.node_rank, Node.id, Node.name, Node.last_heartbeat_at, Node.heartbeat_interval_s,
               Node.heartbeat_lag_s)
        .join(Node, Node.id == AttemptPart.node_id)
        .where(AttemptPart.attempt_id == attempt.id, AttemptPart.state.in_(PART_STARTED),
               Node.last_heartbeat_at.is_not(None))
        .order_by(AttemptPart.node_rank)).all()
    for node_rank, node_id, name, last, interval, lag in rows:
        if last is None:
            continue
        quiet = (t - last).total_seconds()
        if quiet - (lag or 0.0) >= SILENT_HEARTBEATS * (interval or silence.interval_s):
            return node_rank, node_id, name, quiet
    return None


def undecided(session: Session, *, batch: int = 100) -> list[uuid.UUID]:
    """The monitor loop's sweep (settle each, with the loop's ``Silence``): the undecided attempts
    with a failed worker. A failure that waited for its cause's report (``_consequence_pending``) is
    decided there once the grace is over or the cause's node went silent, when no report comes to
    settle it (the cause's node died and its peers' parts already ended)."""
    return list(session.scalars(
        select(Attempt.id).where(
            Attempt.state.in_(ATTEMPT_LIVE), Attempt.outcome.is_(None),
            select(Worker.id).where(Worker.attempt_id == Attempt.id, Worker.state == "exited",
                                    Worker.exit_code.is_not(None), Worker.exit_code != 0).exists())
        .order_by(Attempt.id).limit(batch)).all())


def _consequence_pending(session: Session, attempt: Attempt, failed: tuple[Any, ...]) -> bool:
    """Every failed worker lost a peer or timed out in a collective, just now, and a node still runs:
    usually the consequence of another rank's failure, whose report may be a moment behind. Give it
    that moment, so that the rank that failed first is blamed, not its peers. A part still running
    resends its status every interval (apply_status asks settle again while a failure is undecided;
    a lost node is failed by the monitor), so the decision comes."""
    still_running = session.scalar(select(func.count()).select_from(AttemptPart).where(
        AttemptPart.attempt_id == attempt.id, AttemptPart.state.in_(PART_STARTED)))
    if not still_running:
        return False
    ended = session.execute(select(func.min(Worker.ended_at), func.max(Worker.ended_at)).where(*failed)).one()
    return _recent(list(ended))


def _decide(session: Session, job: Job, attempt: Attempt, silence: Silence | None = None) -> None:
    """Apply the verdict; the caller holds the job and attempt locks."""
    verdict = _verdict(session, attempt, silence)
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
