"""The agent's messages, one transaction-owning service function each (api/agent.py only parses
and answers). Each function commits what it decided before it returns: routes never commit
(tests/control_plane/test_routes_are_thin.py). Scheduler wake-ups come in through ``Wakeups``,
the routes' one runtime dependency (api/deps.py ``RuntimeDep``)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from control_plane import failpoints
from control_plane.models import Attempt, Node
from control_plane.services import events
from control_plane.services.checkpoints import checkpoints
from control_plane.services.cluster import nodes, specs
from control_plane.services.read import metrics, views
from control_plane.services.runs import attempts, intervals, parking, progress, recovery_budget, status_reports
from control_plane.settings import Settings
from trainyard.protocol.agent import (
    AssignmentRef,
    AttemptStatusReport,
    HeartbeatRequest,
    LaunchSpec,
    NodeAttemptState,
    RegisterRequest,
    ShardReport,
    WorkerEventBatch,
)


class Wakeups(Protocol):
    """What a service may ask of the scheduler loops."""

    def wake_scheduler(self) -> None:
        """Run a scheduling pass soon (in the scheduler loop's thread)."""

    def schedule_now(self) -> bool:
        """Run a scheduling pass in this thread, in its own transaction, if this process runs the
        loops; True if it placed something."""


def register(session: Session, req: RegisterRequest, credential: str, wakeups: Wakeups,
             settings: Settings) -> tuple[Node, str, float]:
    """A (re-)registration with a join token or the node's own credential; its GPUs may admit
    waiting jobs. Returns the node, its credential and the heartbeat interval to tell its agent
    (nodes.tell_interval)."""
    node, token = nodes.register(session, req, credential, static_join_token=settings.join_token)  # commits
    interval = nodes.tell_interval(session, node, settings)
    session.commit()
    wakeups.wake_scheduler()
    return node, token, interval


@dataclass(frozen=True)
class HeartbeatAnswer:
    node_state: str
    assignments: list[LaunchSpec]
    unchanged: list[AssignmentRef]
    heartbeat_interval_s: float


def heartbeat_and_schedule(session: Session, node: Node, req: HeartbeatRequest,
                           storage: dict[str, object] | None, wakeups: Wakeups,
                           settings: Settings, arrived_at: datetime | None = None, *,
                           locked: bool = False) -> HeartbeatAnswer:
    """Record a heartbeat and answer with the node's desired attempts (``locked``: the caller
    authenticated the node with its row locked, nodes.authenticate).

    When the heartbeat released the last GPUs of a gang (perhaps the last ones a recovering job
    waits for), a scheduling pass runs now, in its own transaction, and the answer carries its
    result rather than leaving it to the next heartbeat: that is a heartbeat interval off every
    recovery."""
    failpoints.hit("agent.heartbeat")  # a heartbeat held before it is recorded (test_liveness_lane.py)
    with metrics.HEARTBEAT.time():
        return _heartbeat_and_schedule(session, node, req, storage, wakeups, settings, arrived_at, locked)


def _heartbeat_and_schedule(session: Session, node: Node, req: HeartbeatRequest,
                            storage: dict[str, object] | None, wakeups: Wakeups,
                            settings: Settings, arrived_at: datetime | None, locked: bool) -> HeartbeatAnswer:
    released_before, ended_before = _released(session), attempts.ended_count(session)
    node = nodes.heartbeat(session, node, req, arrived_at, locked=locked)
    full, unchanged = specs.answer(session, node.id, req.known, storage)
    interval = nodes.tell_interval(session, node, settings)
    state = node.state
    released = _released(session) != released_before
    if not released:
        # Liveness only (no lease released, no attempt failed): losing this commit in a database
        # crash loses nothing the next heartbeat does not say again, so don't wait for the WAL flush.
        # At 1 heartbeat/s per node that flush was half of a heartbeat's cost (bench/scale.py).
        session.execute(text("SET LOCAL synchronous_commit = off"))
    session.commit()
    if _after_release(session, wakeups, ended_before):
        full, unchanged = specs.answer(session, node.id, req.known, storage)
        session.commit()
    return HeartbeatAnswer(node_state=state, assignments=full, unchanged=unchanged, heartbeat_interval_s=interval)


def _after_release(session: Session, wakeups: Wakeups, ended_before: int) -> bool:
    """After the transactions of a message committed: finish the cancelling jobs its releases
    concern (attempts.finish_released; the release of a gang's last part ended the attempt itself)
    and schedule. A gang that ended (here or in the message's own
    transactions: more than ``ended_before``) frees its GPUs at once, so a pass runs now, in this
    thread (True: it placed something). One node of a larger gang giving its GPUs back only wakes
    the scheduler loop (one pass for many such releases): a pass in every releasing thread made the
    128 releases of a 1,024-rank recovery queue behind each other's passes (bench/scale.py)."""
    released = attempts.released_attempts(session)
    if released:
        attempts.finish_released(session, released)
        session.commit()
    if attempts.ended_count(session) > ended_before:
        if wakeups.schedule_now():
            return True
        # This pass placed nothing, or found another pass holding the lock, which may have read the
        # cluster before this release committed: the loop passes again (and retries while the lock
        # is taken), so the freed gang never waits for the loop's next period.
        wakeups.wake_scheduler()
        return False
    if released:
        wakeups.wake_scheduler()
    return False


def _released(session: Session) -> int:
    return int(session.info.get("released", 0))  # counted by attempts.release_parts


@dataclass(frozen=True)
class StatusAnswer:
    attempt_state: str
    stop: bool
    released: bool
    checkpoint_interval_steps: int | None = None
    """For a job whose checkpoint interval is 'auto': the interval chosen now (services/runs/intervals.py)."""
    handover_ok: bool = False
    """The part told to stop may be parked for a handover (services/runs/parking.py)."""


def report_status(session: Session, node: Node, attempt_id: uuid.UUID, report: AttemptStatusReport,
                  wakeups: Wakeups, *, budgets: Mapping[str, float | None] | None = None) -> StatusAnswer:
    """Merge an attempt status report (status_reports.apply_status, which shares the job and the attempt
    with the other nodes' reports) and commit it; then, if it may have decided something, settle
    the attempt under its exclusive locks (status_reports.settle) and commit that; then release the part
    a final report asked to release (status_reports.release_reported) and commit that. A final report that
    released the last GPUs of a gang schedules at once, as a heartbeat would. The answer carries
    the checkpoint interval the platform chose for an 'auto' job (services/runs/intervals.py). The report
    that brings a recovering attempt's first step closes the recovery: its phases are observed and
    checked against ``budgets`` (the cluster's recovery budgets, under the job's own)."""
    if report.state in (NodeAttemptState.exited, NodeAttemptState.stopped):
        failpoints.hit("agent.final_status")  # a slow final status (fault tests)
    ended_before = attempts.ended_count(session)
    session.info.pop("first_step_at", None)
    merged = status_reports.apply_status(session, node, attempt_id, report)
    session.commit()
    if session.info.pop(status_reports.PARKED, False):
        wakeups.wake_scheduler()  # the next attempt may take the parked part over now
    attempt = merged.attempt
    if merged.settle:
        attempt = status_reports.settle(session, attempt_id, report.result) or attempt
        session.commit()
        if session.info.pop(attempts.RECOVERING, False):
            wakeups.wake_scheduler()  # its GPUs may pass to the next attempt now (handover.pass_leases)
    released = merged.released
    if merged.release:
        # After settle: a verdict this report completes is taken first, and the release of the
        # gang's last part then ends the attempt in its own transaction (attempts.release_parts).
        released = status_reports.release_reported(session, merged.part.id)
        session.commit()
    interval = intervals.current_steps(session, attempt)
    _observe_recovery(session, attempt, session.info.pop("first_step_at", None), budgets)
    session.commit()
    _after_release(session, wakeups, ended_before)
    stop = merged.part.desired == "stop"
    ok = stop and str(attempt.id) in parking.handover_ok(session, node.id, [attempt.id])
    return StatusAnswer(attempt_state=attempt.state, stop=stop, released=released,
                        checkpoint_interval_steps=interval, handover_ok=ok)


def _observe_recovery(session: Session, attempt: Attempt, first_step_at: datetime | None,
                      budgets: Mapping[str, float | None] | None) -> None:
    """The first step of an attempt after a failed one ends a recovery: its phases, once, and an
    event naming each phase over its budget. A report that brought its node's first step
    (``first_step_at``, set by apply_status) brought the attempt's if no other node's first step is
    earlier (committed reports only: of two at once, the earlier)."""
    if first_step_at is None or attempt.number <= 1 or progress.first_at(session, attempt.id) != first_step_at:
        return
    recovery = views.recovery_of(session, attempt, views.job_budgets(session, attempt.job_id, budgets))
    if recovery is None:
        return
    phases = {phase: getattr(recovery, f"{phase}_s") for phase in recovery_budget.PHASES}
    metrics.observe_recovery({**phases, "total": recovery.to_first_step_s})
    if recovery.over_budget:
        overruns = [recovery_budget.Overrun(o.phase, o.seconds, o.budget_s) for o in recovery.over_budget]
        events.record(session, "recovery.over_budget", recovery_budget.describe(overruns, recovery.to_first_step_s),
                      job_id=attempt.job_id, attempt_id=attempt.id,
                      phases=[o.phase for o in overruns], seconds=phases, budget_s=recovery.budget_s,
                      total_s=recovery.to_first_step_s)


def report_shards(session: Session, node: Node, attempt_id: uuid.UUID, report: ShardReport,
                  store: checkpoints.ObjectStore | None,
                  factory: sessionmaker[Session]) -> list[int]:
    """Phase 1 of a checkpoint (its own transaction); when the last shard of a step arrives,
    phase 2 commits it (checkpoints.commit_ready, its own transactions). Returns the steps of the
    report whose own checkpoint is committed (by this request or another replica)."""
    costs: dict[uuid.UUID, tuple[float, float | None]] = {}
    arrived = checkpoints.record_shards(session, node, attempt_id, report, costs)
    session.commit()
    metrics.observe_shards(report)
    # Counted after the commit, in a transaction of its own: of two reports completing a step at
    # once, the later one sees both (checkpoints.count_arrivals). The 128 reports of a 1,024-shard
    # step all increment one row, so the increment comes last and its commit does not wait for the
    # WAL flush: the row is locked for one round trip. A crash that loses an increment leaves the
    # counter short, and the maintenance pass, which counts the shard rows, commits the step.
    steps = {s.step for s in report.shards}
    committed = checkpoints.committed_steps(session, attempt_id, steps)
    session.execute(text("SET LOCAL synchronous_commit = off"))
    ready = checkpoints.count_arrivals(session, arrived, costs)
    session.commit()
    if ready and store is not None:
        for checkpoint_id in ready:
            checkpoints.commit_ready(factory, store, checkpoint_id)
        committed = checkpoints.committed_steps(session, attempt_id, steps)
        session.commit()
    return committed


def report_events(session: Session, node: Node, attempt_id: uuid.UUID, batch: WorkerEventBatch) -> int:
    """Fenced worker events (checkpoints.record_worker_events), committed."""
    failpoints.hit("agent.events")  # slow bookkeeping (tests/control_plane/test_liveness_lane.py)
    accepted = checkpoints.record_worker_events(session, node, attempt_id, batch)
    session.commit()
    return accepted

