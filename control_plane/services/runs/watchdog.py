"""The watchdogs (docs/goodput.md, "Watchdogs"): a running attempt whose step stops advancing is
failed as hung, naming the ranks that stopped reporting, and recovered like any failure; a rank
persistently slower than its peers is named a straggler, with its node.

Both read what the agents already send: each node's step (its part's progress, with when the
control plane saw it advance and the step time it measured) and each node's RankSummary (its own
ranks' steps, timings and silences, with the periodic status report). The
rules are pure (control_plane/goodput/rules.py); here they meet the rows. Every replica runs this
(the watchdog loop): a verdict locks the job and the attempt and is taken once (fail_attempt is
idempotent), a straggler is named by a conditional UPDATE that only one replica wins.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.db import rowcount
from control_plane.goodput.rules import RankTiming, Straggler, hang_timeout_s, stragglers
from control_plane.models import Attempt, AttemptPart, Checkpoint, Job, LogChunk, Node
from control_plane.services import events
from control_plane.services.runs import attempts, progress
from control_plane.services.runs.fencing import lock_attempt
from control_plane.settings import Settings
from trainyard.protocol.agent import RANK_SILENT_AFTER_S


def _override(job_watchdog: dict[str, Any] | None, key: str) -> Any:
    return (job_watchdog or {}).get(key)


@dataclass(frozen=True)
class _Silent:
    rank: int
    node: str
    node_id: uuid.UUID
    silent_s: float
    step: int


def _rank_facts(session: Session, attempt_id: uuid.UUID) -> tuple[list[_Silent], list[_Silent]]:
    """(ranks silent longer than RANK_SILENT_AFTER_S, every rank) of the attempt as its nodes last
    told (every status_interval_s; a node whose agent stopped reporting is the lost-node check's)."""
    rows = session.execute(
        select(AttemptPart.ranks, AttemptPart.node_id, Node.name)
        .join(Node, Node.id == AttemptPart.node_id)
        .where(AttemptPart.attempt_id == attempt_id, AttemptPart.ranks.is_not(None))
    ).all()
    every: list[_Silent] = []
    for summary, node_id, name in rows:
        for r in (summary or {}).get("ranks", []):
            every.append(_Silent(rank=int(r["rank"]), node=name, node_id=node_id,
                                 silent_s=float(r.get("silent_s", 0.0)), step=int(r.get("step", 0))))
    silent = sorted((r for r in every if r.silent_s >= RANK_SILENT_AFTER_S), key=lambda r: (-r.silent_s, r.rank))
    return silent, every


def _who(silent: list[_Silent], every: list[_Silent]) -> tuple[str, uuid.UUID | None, list[int]]:
    """Words naming the ranks to blame, the node blamed, and those ranks."""
    if silent:
        by_node: dict[str, list[int]] = {}
        for r in silent:
            by_node.setdefault(r.node, []).append(r.rank)
        named = "; ".join(f"rank{'s' if len(v) > 1 else ''} {', '.join(map(str, sorted(v)))} on {n}"
                          for n, v in by_node.items())
        return f"{named} stopped reporting", silent[0].node_id, sorted(r.rank for r in silent)
    if every:
        low = min(r.step for r in every)
        behind = [r for r in every if r.step == low]
        if len(behind) < len(every):
            ranks = sorted(r.rank for r in behind)
            return (f"ranks {', '.join(map(str, ranks))} are behind at step {low} (every rank still reports)",
                    behind[0].node_id, ranks)
        return "every rank still reports, none advances (a collective or the data pipeline is stuck)", None, []
    return "no rank summary arrived from its nodes", None, []


FINISHING_TIMEOUT_S = 120.0
"""The least hang timeout of an attempt that reported its job's last step (total_steps)."""


def fail_hung(session: Session, settings: Settings) -> list[uuid.UUID]:
    """Fail every running attempt whose step has not advanced within its hang timeout; returns them."""
    at = now()
    stall = (select(Checkpoint.job_id, func.max(Checkpoint.blocking_s).label("stall"))
             .group_by(Checkpoint.job_id).subquery())
    # Each node's reports advance its own part (status reports never write the attempt row): the
    # attempt advanced when any of its parts did, and the slowest part's step time sets the timeout.
    parts = (select(AttemptPart.attempt_id, func.max(AttemptPart.step_advanced_at).label("advanced_at"),
                    func.max(AttemptPart.step_time_s).label("step_time"),
                    func.max(AttemptPart.progress_step).label("step"),
                    func.max(AttemptPart.progress_total).label("total"))
             .where(AttemptPart.step_advanced_at.is_not(None))
             .group_by(AttemptPart.attempt_id).subquery())
    rows = session.execute(
        select(Attempt.id, parts.c.advanced_at, parts.c.step_time, Job.watchdog, stall.c.stall, parts.c.step,
               parts.c.total)
        .join(parts, parts.c.attempt_id == Attempt.id)
        .join(Job, Job.id == Attempt.job_id)
        .outerjoin(stall, stall.c.job_id == Attempt.job_id)
        .where(Attempt.state == "running", Attempt.outcome.is_(None))
    ).all()
    failed: list[uuid.UUID] = []
    for attempt_id, advanced_at, step_time, watchdog, longest_stall, last_step, total in rows:
        timeout = hang_timeout_s(step_time_s=step_time, longest_stall_s=longest_stall,
                                 floor_s=settings.hang_timeout_min_s, multiplier=settings.hang_step_multiplier,
                                 override_s=_override(watchdog, "hang_timeout_s"))
        if total is not None and last_step is not None and last_step >= total:
            # The job took its last step: no step will advance again, and what is left (the last
            # save's upload, the result, the processes' exit) is not a step. A frozen end is still
            # caught, later; the e2e watchdog test's recovered attempt was failed as hung at step
            # 240 of 240 while it uploaded its last checkpoint on a loaded machine.
            timeout = max(timeout, FINISHING_TIMEOUT_S)
        if (at - advanced_at).total_seconds() <= timeout:
            continue
        locked = lock_attempt(session, attempt_id)
        if locked is None:
            continue
        job, attempt = locked
        if attempt.outcome is not None or _advanced_at(session, attempt.id) != advanced_at:
            continue  # decided meanwhile, or it moved on
        step = progress.step_of(session, attempt.id)
        idle = (at - advanced_at).total_seconds()
        silent, every = _rank_facts(session, attempt.id)
        who, node_id, ranks = _who(silent, every)
        basis = ("the job's watchdog.hang_timeout_s" if _override(watchdog, "hang_timeout_s") is not None else
                 f"from its step time {step_time or 0:.3g}s and longest checkpoint stall {longest_stall or 0:.3g}s, "
                 f"floor {settings.hang_timeout_min_s:g}s")
        reason = (f"hung: step {step} has not advanced for {idle:.1f}s (hang timeout {timeout:.3g}s, "
                  f"{basis}); {who}")
        attempt.hung_since = advanced_at
        events.record(session, "attempt.hung", reason, job_id=job.id, attempt_id=attempt.id, node_id=node_id,
                      ranks=ranks, step=step, idle_s=round(idle, 3), timeout_s=round(timeout, 3))
        attempts.fail_attempt(session, job, attempt, reason, node_id=node_id)
        session.commit()
        failed.append(attempt.id)
    return failed


# --- Startup: an attempt that never reports a first step (issue 24) ---
# fail_hung needs a step that advanced once; workers that never get there (DataLoader workers that
# died, a rendezvous or a restore stuck) would leave the attempt running forever. So an attempt all
# of whose workers run but none of whose parts ever advanced a step fails after startup_timeout_s,
# and the reason carries what the ranks last wrote to stderr: the usual clue.

STDERR_LINES = 3
"""Lines of each rank's stderr in a not-starting attempt's reason."""
STDERR_RANKS = 8
"""Ranks quoted at most (the reason stays readable; the logs have the rest)."""


def fail_not_started(session: Session, settings: Settings) -> list[uuid.UUID]:
    """Fail every running attempt that has reported no step ``startup_timeout_s`` after all its workers
    started; returns them."""
    at = now()
    deadline = at - timedelta(seconds=settings.startup_timeout_s)
    advanced = select(AttemptPart.attempt_id).where(AttemptPart.step_advanced_at.is_not(None))
    candidates = session.scalars(
        select(Attempt.id).where(Attempt.state == "running", Attempt.outcome.is_(None),
                                 Attempt.started_at.is_not(None), Attempt.started_at < deadline,
                                 Attempt.id.not_in(advanced))
    ).all()
    failed: list[uuid.UUID] = []
    for attempt_id in candidates:
        locked = lock_attempt(session, attempt_id)
        if locked is None:
            continue
        job, attempt = locked
        if attempt.outcome is not None or _advanced_at(session, attempt.id) is not None:
            continue  # decided meanwhile, or its first step arrived
        waited = (at - attempt.started_at).total_seconds() if attempt.started_at else settings.startup_timeout_s
        last = last_stderr(session, attempt.id)
        reason = (f"not started: no rank reported a first step {waited:.0f}s after every worker was running "
                  f"(startup timeout {settings.startup_timeout_s:g}s, TRAINYARD_STARTUP_TIMEOUT_S); "
                  + (f"last stderr: {last}" if last else "no rank wrote to stderr"))
        attempt.hung_since = attempt.started_at  # the goodput's hung time; its workers are not parked
        events.record(session, "attempt.not_started", reason, job_id=job.id, attempt_id=attempt.id,
                      waited_s=round(waited, 3), timeout_s=settings.startup_timeout_s)
        attempts.fail_attempt(session, job, attempt, reason)
        session.commit()
        failed.append(attempt.id)
    return failed


def last_stderr(session: Session, attempt_id: uuid.UUID) -> str:
    """The last STDERR_LINES lines each rank (up to STDERR_RANKS) wrote to stderr, in one line."""
    ranks = session.execute(
        select(LogChunk.node_rank, LogChunk.rank).where(LogChunk.attempt_id == attempt_id,
                                                        LogChunk.stream == "stderr")
        .distinct().order_by(LogChunk.node_rank, LogChunk.rank).limit(STDERR_RANKS)
    ).all()
    quoted = []
    for node_rank, rank in ranks:
        chunks = session.scalars(
            select(LogChunk.data).where(LogChunk.attempt_id == attempt_id, LogChunk.node_rank == node_rank,
                                        LogChunk.rank == rank, LogChunk.stream == "stderr")
            .order_by(LogChunk.offset.desc()).limit(STDERR_LINES)
        ).all()
        lines = [line.strip() for line in "".join(reversed(chunks)).splitlines() if line.strip()]
        tail = " | ".join(line[:300] for line in lines[-STDERR_LINES:])
        quoted.append(f"[node {node_rank} rank {rank}] {tail}")
    return "; ".join(quoted)


def _advanced_at(session: Session, attempt_id: uuid.UUID) -> datetime | None:
    """When any part of the attempt last advanced its step."""
    value: datetime | None = session.scalar(
        select(func.max(AttemptPart.step_advanced_at)).where(AttemptPart.attempt_id == attempt_id))
    return value


def track_stragglers(session: Session, settings: Settings) -> list[Straggler]:
    """Mark each part's rank that is slower than its peers now (``straggler_since``); name the ones
    slow for ``straggler_persist_s`` (an event, once). Returns those named now."""
    at = now()
    rows = session.execute(
        select(AttemptPart.id, AttemptPart.attempt_id, AttemptPart.node_id, AttemptPart.ranks,
               AttemptPart.straggler_rank, AttemptPart.straggler_since, AttemptPart.straggler_named_at,
               Attempt.job_id, Job.watchdog, Node.name)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .join(Node, Node.id == AttemptPart.node_id)
        .where(Attempt.state == "running", Attempt.outcome.is_(None), AttemptPart.ranks.is_not(None))
        .order_by(AttemptPart.attempt_id, AttemptPart.id)
    ).all()
    by_attempt: dict[uuid.UUID, list[Any]] = {}
    for row in rows:
        by_attempt.setdefault(row.attempt_id, []).append(row)
    named: list[Straggler] = []
    for parts in by_attempt.values():
        factor = _override(parts[0].watchdog, "straggler_factor") or settings.straggler_factor
        slow = {s.node: s for s in stragglers(timings(parts), factor)}
        for part in parts:
            found = slow.get(str(part.id))
            if found is None:
                if part.straggler_rank is not None:
                    session.execute(update(AttemptPart).where(AttemptPart.id == part.id).values(
                        straggler_rank=None, straggler_since=None, straggler_named_at=None))
                continue
            if part.straggler_rank != found.rank:
                session.execute(update(AttemptPart).where(AttemptPart.id == part.id).values(
                    straggler_rank=found.rank, straggler_since=at, straggler_named_at=None))
                continue
            since = part.straggler_since or at
            if part.straggler_named_at is not None or at - since < timedelta(seconds=settings.straggler_persist_s):
                continue
            won = rowcount(session.execute(update(AttemptPart).where(
                AttemptPart.id == part.id, AttemptPart.straggler_named_at.is_(None),
                AttemptPart.straggler_rank == found.rank).values(straggler_named_at=at)))
            if won:
                events.record(
                    session, "attempt.straggler",
                    f"rank {found.rank} on {part.name} is {found.ratio:.2f}x slower than its peers' median "
                    f"({found.busy_s:.3g}s vs {found.peers_busy_s:.3g}s per step) "
                    f"for {(at - since).total_seconds():.0f}s",
                    job_id=part.job_id, attempt_id=part.attempt_id, node_id=part.node_id, rank=found.rank,
                    node=part.name, busy_s=round(found.busy_s, 4), peers_busy_s=round(found.peers_busy_s, 4),
                    ratio=found.ratio, factor=factor)
                named.append(found)
    session.commit()
    return named


def timings(parts: list[Any]) -> list[RankTiming]:
    """Every rank of the attempt's parts' summaries (``ranks`` JSON), keyed by the part's id."""
    return [RankTiming(node=str(p.id), rank=int(r["rank"]), busy_s=r.get("busy_s"), step_time_s=r.get("step_time_s"))
            for p in parts for r in (p.ranks or {}).get("ranks", [])]
