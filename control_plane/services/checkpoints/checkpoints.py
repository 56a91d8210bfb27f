"""Two-phase checkpoints: shards are recorded as they arrive (phase 1), then one conditional
update publishes the manifest (phase 2). Only ``committed`` checkpoints exist for readers.

Phase 1 (``record_shards``, one transaction): a shard is accepted only from the job's current
attempt with the right fencing token, and only for its own (attempt, step); a resent shard is
stored once, a different shard under the same (step, rank) is refused.

Phase 2 (``commit_ready``): outside any transaction, every shard object is checked in S3 (size)
and the manifest is written next to them; then one transaction flips ``pending -> committed``
with ``WHERE state = 'pending'`` while the attempt is still the job's current one. That row
update is the commit point: two replicas racing to commit produce one commit, and a crash before
it leaves a pending checkpoint that the next pass commits or aborts. See docs/architecture.md.

Usability and lineage: a committed checkpoint that a restore found bad (a worker's
``checkpoint.fallback`` event) becomes ``unusable`` with the reason, and no restore plan names it
again. Checkpoints are ranked by lineage, not by step alone: a later attempt continues from what
it restored (or from scratch), so its checkpoints are more recent than any of an earlier attempt,
whatever their steps. Retention keeps the newest ``keep_last`` usable ones in that order, and only
a more recent checkpoint of the lineage supersedes a pending one. Every state change goes through
one mutator over the table ``CHECKPOINT`` (services/states.py) and records an event.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections.abc import Iterable
from typing import Any, Protocol

import structlog
from sqlalchemy import ColumnElement, Float, and_, func, literal, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.orm import Session, sessionmaker

from control_plane import failpoints
from control_plane.clock import now
from control_plane.db import rowcount, session_scope
from control_plane.errors import Conflict, StaleAttempt
from control_plane.models import Attempt, AttemptPart, Checkpoint, CheckpointShard, Job, Node
from control_plane.services import events
from control_plane.services.checkpoints.memtier_facts import restored_tiers
from control_plane.services.runs import progress
from control_plane.services.runs.fencing import authorize_report, check_own_ranks
from control_plane.services.states import (
    CHECKPOINT,
    CHECKPOINT_COLLECTED,
    CHECKPOINT_TERMINAL,
    NODE_UNREACHABLE,
    set_checkpoint_state,
)
from trainyard.protocol import keys
from trainyard.protocol.agent import (
    RESTORE_CANDIDATES_MAX,
    RESTORE_PLAN_FORMAT,
    WORKER_CHECKPOINT_EVENTS,
    RestoreCandidate,
    RestorePlan,
    ShardReport,
)

log = structlog.get_logger("trainyard.checkpoints")

# Keys that events.record takes as arguments: a worker's event data must not collide with them.
RESERVED_EVENT_KEYS = frozenset({"session", "kind", "message", "job_id", "attempt_id", "node_id", "rank", "event"})


# The checkpoint state table and its mutator live with the others, in services/states.py
# (``CHECKPOINT``, ``set_checkpoint_state``); these names are its view here: from -> {to: event kind}.
TRANSITIONS: dict[str, dict[str, str]] = {
    state: {to: f"checkpoint.{to}" for to in sorted(spec.to)} for state, spec in CHECKPOINT.items()
}
TERMINAL = CHECKPOINT_TERMINAL
COLLECTED = CHECKPOINT_COLLECTED  # states whose objects are deleted from storage


def transition(session: Session, ckpt: Checkpoint, to: str, message: str, *, reason: str | None = None,
               **data: Any) -> bool:
    """Applies ``ckpt.state -> to`` if the table allows it and records the event; False (and
    nothing changes) otherwise (states.set_checkpoint_state)."""
    return set_checkpoint_state(session, ckpt, to, message, reason=reason, **data)


class ObjectStore(Protocol):
    def put_object(self, key: str, data: Any, *, length: int | None = None) -> Any: ...
    def stat(self, key: str) -> Any: ...
    def list_objects(self, prefix: str) -> Iterable[Any]: ...  # ObjectInfo (key, size) of each key under prefix
    def delete(self, key: str) -> None: ...


def checkpoint_prefix(job_id: uuid.UUID | str, step: int, attempt_number: int) -> str:
    """Where an attempt's shards of one step live: scoped to job, step and attempt."""
    return keys.step_prefix(keys.job_checkpoint_prefix(job_id), step, attempt_number)


def record_shards(session: Session, node: Node, attempt_id: uuid.UUID, report: ShardReport,
                  costs: dict[uuid.UUID, tuple[float, float | None]] | None = None) -> dict[uuid.UUID, int]:
    """Phase 1: record a node's shards. Returns the pending checkpoints that got new shards, with how
    many; after the caller commits, :func:`count_arrivals` says which are complete. ``costs`` (if
    given) receives, per checkpoint, the longest blocking and background seconds the new shards report.

    Costs O(the report's shards), whatever the world size, and does not serialize with the other
    nodes' reports: the job and the attempt are only shared (authorize_report ``exclusive=False``),
    the checkpoint row is created with ``INSERT ... ON CONFLICT DO NOTHING`` and never locked here,
    and the shards are inserted in one statement (``ON CONFLICT DO NOTHING RETURNING``)."""
    job, attempt, part = authorize_report(session, node, attempt_id, report.fencing_token, report.node_rank,
                                          exclusive=False)
    if attempt.outcome is not None and attempt.outcome != "failed":
        raise StaleAttempt(f"attempt {attempt.number} already ended ({attempt.outcome}); shard refused")
    by_step: dict[int, dict[int, Any]] = {}
    for shard in report.shards:
        if shard.world_size != attempt.num_gpus:
            raise Conflict(f"shard of rank {shard.rank} says world size {shard.world_size}; "
                           f"attempt {attempt.number} has {attempt.num_gpus} ranks")
        if shard.rank >= attempt.num_gpus:
            raise Conflict(f"rank {shard.rank} is outside attempt {attempt.number}'s world")
        # The exact key, built as workers build it (trainyard/protocol/keys.py): a prefix check let
        # ".../attempt-0001/../../jobs/<other job>/..." through.
        expected = keys.shard_key(keys.job_checkpoint_prefix(job.id), shard.step, attempt.number, shard.rank)
        if shard.key != expected:
            raise Conflict(f"shard key {shard.key!r} is not this attempt's key for rank {shard.rank} at step "
                           f"{shard.step}: {expected!r}")
        seen = by_step.setdefault(shard.step, {})
        if shard.rank in seen and _shard_facts(seen[shard.rank]) != _shard_facts(shard):
            raise Conflict(f"rank {shard.rank} reported two different shards for step {shard.step}")
        seen[shard.rank] = shard
    check_own_ranks(session, part, {rank for shards in by_step.values() for rank in shards})
    arrived: dict[uuid.UUID, int] = {}
    for step in sorted(by_step):
        ckpt_id, state = _pending_checkpoint(session, job, attempt, step)
        if state != "pending":
            continue  # already committed or aborted: a late duplicate changes nothing
        shards = by_step[step]
        inserted = set(session.scalars(
            pg_insert(CheckpointShard)
            .values([{"id": uuid.uuid4(), "checkpoint_id": ckpt_id, "rank": sh.rank, "key": sh.key,
                      "size_bytes": sh.size_bytes, "sha256": sh.sha256, **_upload_facts(sh)}
                     for sh in shards.values()])
            .on_conflict_do_nothing(index_elements=["checkpoint_id", "rank"])
            .returning(CheckpointShard.rank)
        ))
        resent = [rank for rank in shards if rank not in inserted]
        if resent:  # a resend is stored once; a different shard under the same rank is refused
            for have in session.execute(select(CheckpointShard.rank, CheckpointShard.key, CheckpointShard.sha256,
                                               CheckpointShard.size_bytes)
                                        .where(CheckpointShard.checkpoint_id == ckpt_id,
                                               CheckpointShard.rank.in_(resent))):
                if (have.key, have.sha256, have.size_bytes) != _shard_facts(shards[have.rank]):
                    raise Conflict(f"rank {have.rank} already reported a different shard for step {step}")
        if inserted:
            arrived[ckpt_id] = len(inserted)
            blocking = [b for r in inserted if (b := shards[r].blocking_s) is not None]
            background = [b for r in inserted if (b := shards[r].background_s) is not None]
            if costs is not None and blocking:
                costs[ckpt_id] = (max(blocking), max(background) if background else None)
    return arrived


def _upload_facts(shard: Any) -> dict[str, Any]:
    """What the shard's upload cost (its slot wait; trainyard/protocol/uploads.py UploadStats)."""
    up = shard.upload
    if up is None:
        return {"upload_wait_s": None, "upload_s": None, "upload_slot": None}
    return {"upload_wait_s": up.wait_s, "upload_s": up.upload_s, "upload_slot": up.slot}


def _shard_facts(shard: Any) -> tuple[str, str, int]:
    return shard.key, shard.sha256, shard.size_bytes


def _pending_checkpoint(session: Session, job: Job, attempt: Attempt, step: int) -> tuple[uuid.UUID, str]:
    """The attempt's checkpoint of ``step``, created (``pending``, with its event) if none: its id and
    state. Concurrent reports of one step create it once, without waiting for each other's locks."""
    created = session.scalar(
        pg_insert(Checkpoint)
        .values(id=uuid.uuid4(), job_id=job.id, attempt_id=attempt.id, step=step, world_size=attempt.num_gpus,
                state="pending", created_at=now())
        .on_conflict_do_nothing(index_elements=["job_id", "attempt_id", "step"])
        .returning(Checkpoint.id)
    )
    if created is not None:
        events.record(session, "checkpoint.begun", f"checkpoint of step {step} begun",
                      job_id=job.id, attempt_id=attempt.id, step=step)
        return created, "pending"
    row = session.execute(select(Checkpoint.id, Checkpoint.state).where(
        Checkpoint.job_id == job.id, Checkpoint.attempt_id == attempt.id, Checkpoint.step == step)).one()
    return row.id, row.state


def count_arrivals(session: Session, arrived: dict[uuid.UUID, int],
                   costs: dict[uuid.UUID, tuple[float, float | None]] | None = None) -> list[uuid.UUID]:
    """After the shard report committed: add its new shards to each checkpoint's counter; the
    checkpoints now complete (ready for :func:`commit_ready`). The caller commits.

    A transaction of its own, after the shards' commit, so that of two reports that complete a
    step at once the later one counts the other's shards too, and the counter row is locked only
    for the increment. A crash between the two commits leaves the counter short: the maintenance
    pass, which counts the shards themselves, commits that checkpoint. The same update keeps the
    checkpoint's longest blocking and background times (``costs``: the save's cost, for goodput and
    the auto interval) without another lock of the row."""
    if not arrived:
        return []
    ready: list[uuid.UUID] = []
    for ckpt_id in sorted(arrived):  # id order (services/locks.py)
        # GREATEST skips NULLs: a shard that reported no cost (an older worker) changes nothing.
        blocking, background = (costs or {}).get(ckpt_id, (None, None))
        row = session.execute(
            update(Checkpoint)
            .where(Checkpoint.id == ckpt_id, Checkpoint.state == "pending")
            .values(shards_received=Checkpoint.shards_received + arrived[ckpt_id],
                    blocking_s=func.greatest(Checkpoint.blocking_s, literal(blocking, Float)),
                    background_s=func.greatest(Checkpoint.background_s, literal(background, Float)))
            .returning(Checkpoint.shards_received, Checkpoint.world_size)
        ).one_or_none()
        if row is not None and row.shards_received >= row.world_size:
            ready.append(ckpt_id)
    return ready


def committed_steps(session: Session, attempt_id: uuid.UUID, steps: set[int]) -> list[int]:
    """Which of ``steps`` have a committed checkpoint of this attempt (for the shard ack: a step
    is acknowledged as committed only if its own checkpoint is, whoever committed it)."""
    if not steps:
        return []
    return sorted(session.scalars(select(Checkpoint.step).where(
        Checkpoint.attempt_id == attempt_id, Checkpoint.step.in_(steps), Checkpoint.state == "committed")))


def _manifest(job: Job, attempt: Attempt, ckpt: Checkpoint, shards: list[CheckpointShard], key: str) -> dict[str, Any]:
    return {
        "format": keys.MANIFEST_FORMAT,
        "job_id": str(job.id),
        "checkpoint_id": str(ckpt.id),
        "step": ckpt.step,
        "attempt_id": str(attempt.id),
        "attempt_number": attempt.number,
        "world_size": ckpt.world_size,
        "layout": {"num_nodes": job.num_nodes, "gpus_per_node": job.gpus_per_node},
        "manifest_key": key,
        "shards": [{"rank": s.rank, "key": s.key, "size_bytes": s.size_bytes, "sha256": s.sha256}
                   for s in sorted(shards, key=lambda s: s.rank)],
    }


def commit_ready(factory: sessionmaker[Session], store: ObjectStore, checkpoint_id: uuid.UUID) -> bool:
    """Phase 2 for one checkpoint; True if this call committed it."""
    with session_scope(factory) as s:
        ckpt = s.get(Checkpoint, checkpoint_id)
        if ckpt is None or ckpt.state != "pending":
            return False
        shards = list(s.scalars(select(CheckpointShard).where(CheckpointShard.checkpoint_id == ckpt.id)))
        if len(shards) != ckpt.world_size:
            return False
        job = s.get(Job, ckpt.job_id)
        attempt = s.get(Attempt, ckpt.attempt_id)
        assert job is not None and attempt is not None
        prefix = checkpoint_prefix(job.id, ckpt.step, attempt.number) + "/"
        key = keys.manifest_key(keys.job_checkpoint_prefix(job.id), ckpt.step, attempt.number)
        manifest = _manifest(job, attempt, ckpt, shards, key)
    # Network calls, outside any transaction: verify every shard exists with its size, from one
    # listing of the attempt's step prefix (every shard key is under it: record_shards), not one
    # request per shard.
    try:
        sizes = {o.key: o.size for o in store.list_objects(prefix)}
        for shard in manifest["shards"]:
            if sizes.get(shard["key"]) != shard["size_bytes"]:
                return _abort(factory, checkpoint_id, f"shard of rank {shard['rank']} is missing or has the wrong size")
        payload = json.dumps(manifest, indent=1, sort_keys=True).encode()
        store.put_object(key, io.BytesIO(payload), length=len(payload))
        manifest_sha256 = hashlib.sha256(payload).hexdigest()
    except Exception as exc:  # S3 down: leave it pending; the loop retries, then aborts
        log.warning("checkpoint commit deferred", checkpoint_id=str(checkpoint_id), error=repr(exc))
        return False
    # A crash here leaves a manifest object beside a pending row: not a commit (readers go by the
    # row), and the next maintenance pass writes the same manifest again and commits.
    failpoints.hit("checkpoint.before_commit")
    with session_scope(factory) as s:
        job = s.get(Job, manifest_job_id := uuid.UUID(manifest["job_id"]), with_for_update={"key_share": True})
        if job is None or str(job.current_attempt_id) != manifest["attempt_id"]:
            s.rollback()
            _abort(factory, checkpoint_id, "its attempt is no longer the job's current one")
            return False
        size = sum(sh["size_bytes"] for sh in manifest["shards"])
        # The commit point: a compare-and-set of pending -> committed (states.CHECKPOINT), so that
        # two replicas racing here commit once; the winner records the event.
        done = rowcount(s.execute(
            update(Checkpoint)
            .where(Checkpoint.id == checkpoint_id, Checkpoint.state == "pending")
            .values(state="committed", manifest_key=key, manifest=manifest, size_bytes=size, committed_at=now(),
                    manifest_sha256=manifest_sha256, manifest_size_bytes=len(payload))
        ))
        if done:
            events.record(s, TRANSITIONS["pending"]["committed"],
                          f"checkpoint of step {manifest['step']} committed ({size} bytes, "
                          f"{manifest['world_size']} shards)",
                          job_id=manifest_job_id, attempt_id=uuid.UUID(manifest["attempt_id"]),
                          step=manifest["step"], size_bytes=size, manifest_key=key,
                          checkpoint_id=str(checkpoint_id))
        return bool(done)


def _abort(factory: sessionmaker[Session], checkpoint_id: uuid.UUID, reason: str) -> bool:
    with session_scope(factory) as s:
        ckpt = s.get(Checkpoint, checkpoint_id, with_for_update={"key_share": True})
        if ckpt is not None:
            abort(s, ckpt, reason)
    return False


def abort(session: Session, ckpt: Checkpoint, reason: str) -> None:
    transition(session, ckpt, "aborted", f"checkpoint of step {ckpt.step} aborted: {reason}", reason=reason)


def demote(session: Session, ckpt: Checkpoint, reason: str) -> bool:
    """A restore found this committed checkpoint bad: no restore plan names it again."""
    return transition(session, ckpt, "unusable", f"checkpoint of step {ckpt.step} is unusable: {reason}",
                      reason=reason)


def list_checkpoints(session: Session, job_id: uuid.UUID, *, states: tuple[str, ...] | None = None) -> list[Checkpoint]:
    stmt = (
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.created_at.desc())
    )
    if states:
        stmt = stmt.where(Checkpoint.state.in_(states))
    return list(session.scalars(stmt))


def usable_by_lineage(session: Session, job_id: uuid.UUID) -> list[tuple[Checkpoint, int]]:
    """The job's committed (usable) checkpoints with their attempt's number, most recent of the
    lineage first: a later attempt's before an earlier one's, then by step."""
    return [(c, int(n)) for c, n in session.execute(
        select(Checkpoint, Attempt.number)
        .join(Attempt, Attempt.id == Checkpoint.attempt_id)
        .where(Checkpoint.job_id == job_id, Checkpoint.state == "committed")
        .order_by(Attempt.number.desc(), Checkpoint.step.desc())
    ).all()]


def _more_recent(ckpt: Checkpoint, attempt_number: int) -> ColumnElement[bool]:
    """Checkpoints of the job more recent in its lineage than ``ckpt`` (of attempt ``attempt_number``)."""
    return and_(Checkpoint.job_id == ckpt.job_id, or_(
        Attempt.number > attempt_number,
        and_(Checkpoint.attempt_id == ckpt.attempt_id, Checkpoint.step > ckpt.step),
    ))


def restore_plan(session: Session, job: Job) -> dict[str, Any] | None:
    """References to the usable checkpoints a new attempt may restore from, most recent first.

    Bounded by keep_last (and RESTORE_CANDIDATES_MAX), never by the world size: workers read each
    candidate's manifest from storage and check it against the sha256 and size given here."""
    keep = min(_keep_last(job), RESTORE_CANDIDATES_MAX)
    candidates = [
        RestoreCandidate(checkpoint_id=str(c.id), step=c.step, attempt_number=number, world_size=c.world_size,
                         manifest_key=c.manifest_key, manifest_sha256=c.manifest_sha256,
                         manifest_size_bytes=c.manifest_size_bytes)
        for c, number in usable_by_lineage(session, job.id) if c.manifest_key
    ][:keep]
    if not candidates:
        return None
    return RestorePlan(format=RESTORE_PLAN_FORMAT, candidates=candidates).model_dump(mode="json")


def _keep_last(job: Job) -> int:
    return max(int((job.checkpoint or {}).get("keep_last") or 3), 1)


def _job_checkpoint(session: Session, job: Job, data: dict[str, Any]) -> Checkpoint | None:
    """The job's checkpoint a worker event names (by checkpoint_id, else by a committed step)."""
    raw = data.get("checkpoint_id")
    if raw is not None:
        try:
            cid = uuid.UUID(str(raw))
        except ValueError:
            return None
        return session.scalar(select(Checkpoint).where(Checkpoint.id == cid, Checkpoint.job_id == job.id)
                              .with_for_update())
    step = data.get("step")
    if not isinstance(step, int):
        return None
    return session.scalar(select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step,
                                                   Checkpoint.state == "committed")
                          .order_by(Checkpoint.created_at.desc()).limit(1).with_for_update())


def _found_bad(data: dict[str, Any], message: str) -> bool:
    """Whether a fallback is evidence against the checkpoint (storage trouble is not)."""
    flag = data.get("unusable")
    if isinstance(flag, bool):
        return flag
    return "storage error" not in message  # a worker runtime that predates the flag


def record_worker_events(session: Session, node: Node, attempt_id: uuid.UUID, batch: Any) -> int:
    """Fenced worker events: restore outcomes and failed saves become checkpoint facts."""
    # Only a restore outcome changes the attempt row; the rest are shared with the other nodes' reports.
    exclusive = any(ev.kind == "checkpoint.restored" for ev in batch.events)
    job, attempt, _ = authorize_report(session, node, attempt_id, batch.fencing_token, batch.node_rank,
                                       exclusive=exclusive)
    for ev in batch.events:
        step = ev.data.get("step")
        if ev.kind == "checkpoint.restored" and isinstance(step, int):
            if attempt.restored_from_step is None:
                attempt.restored_from_step = step
                restored = _job_checkpoint(session, job, ev.data)
                attempt.restored_from_checkpoint_id = restored.id if restored is not None else None
                previous = session.scalar(select(Attempt.id).where(
                    Attempt.job_id == job.id, Attempt.number == attempt.number - 1))
                before = progress.step_of(session, previous) if previous is not None else None
                lost = (before or 0) - step
                facts: dict[str, Any] = {"step": step, "steps_lost": max(lost, 0)}
                tiers = restored_tiers(ev.data)  # which tier (memory, peer, S3) served each rank
                if tiers is not None:
                    facts["tiers"] = tiers
                events.record(session, "checkpoint.restored", f"attempt {attempt.number} restored step {step}",
                              job_id=job.id, attempt_id=attempt.id, **facts)
            continue
        if ev.kind == "checkpoint.fallback":
            bad = _job_checkpoint(session, job, ev.data)
            if bad is not None and _found_bad(ev.data, ev.message):
                reason = str(ev.data.get("reason") or ev.message)[:1024]
                demote(session, bad, f"attempt {attempt.number} could not restore it: {reason}")
            # and the fallback itself is recorded below, as every other worker event
        if ev.kind == "checkpoint.save_failed" and isinstance(step, int):
            ckpt = session.scalar(select(Checkpoint).where(
                Checkpoint.job_id == job.id, Checkpoint.attempt_id == attempt.id, Checkpoint.step == step
            ).with_for_update(key_share=True))
            if ckpt is None:
                ckpt = Checkpoint(id=uuid.uuid4(), job_id=job.id, attempt_id=attempt.id, step=step,
                                  world_size=attempt.num_gpus, state="pending", created_at=now())
                session.add(ckpt)
                session.flush()
            abort(session, ckpt, f"rank {ev.rank} could not save: {ev.message}")
            continue
        # Only the worker kinds keep their name: a worker cannot write checkpoint.committed (or any
        # other control-plane kind); anything else is recorded as worker.<kind>.
        events.record(session, ev.kind if ev.kind in WORKER_CHECKPOINT_EVENTS else f"worker.{ev.kind}",
                      f"rank {ev.rank}: {ev.message}", job_id=job.id, attempt_id=attempt.id,
                      rank=ev.rank, **{k: v for k, v in ev.data.items() if k not in RESERVED_EVENT_KEYS})
    return len(batch.events)


def maintenance(factory: sessionmaker[Session], store: ObjectStore | None, *, pending_timeout_s: float) -> None:
    """Commit complete pending checkpoints, abort hopeless ones, apply retention, delete objects."""
    with session_scope(factory) as s:
        pending = list(s.scalars(select(Checkpoint).where(Checkpoint.state == "pending")))
        ready, hopeless = [], []
        for c in pending:
            attempt = s.get(Attempt, c.attempt_id)
            job = s.get(Job, c.job_id)
            shards = s.scalar(select(func.count()).where(CheckpointShard.checkpoint_id == c.id)) or 0
            # Superseded only by a more recent checkpoint of the lineage: not by an earlier
            # attempt's at a higher step (after a fallback or a fresh start, the new run's lower
            # steps are the newest state there is).
            newer = None if attempt is None else s.scalar(
                select(Checkpoint.id).join(Attempt, Attempt.id == Checkpoint.attempt_id)
                .where(_more_recent(c, attempt.number), Checkpoint.state == "committed").limit(1))
            age = (now() - c.created_at).total_seconds()
            if shards == c.world_size and job is not None and job.current_attempt_id == c.attempt_id:
                ready.append(c.id)
            elif newer is not None:
                hopeless.append((c, "superseded by a newer committed checkpoint before all shards arrived"))
            elif attempt is not None and attempt.outcome is not None and attempt.state == "ended":
                hopeless.append((c, f"attempt {attempt.number} ended before all shards arrived"))
            elif attempt is not None and attempt.outcome is not None and job is not None and (
                    job.current_attempt_id != c.attempt_id or _lost_nodes(s, attempt)):
                # Decided, and it can never be committed: a newer attempt is the job's current one
                # (a commit needs its own to be), or a node it needs shards of is lost. Aborted now,
                # not after pending_timeout_s: until then it showed as pending (issue 26).
                lost = _lost_nodes(s, attempt)
                why = f" (node {', '.join(lost)} lost)" if lost else ""
                hopeless.append((c, f"attempt {attempt.number} {attempt.outcome} before all shards arrived{why}"))
            elif age > pending_timeout_s:
                hopeless.append((c, f"incomplete after {pending_timeout_s:g}s ({shards}/{c.world_size} shards)"))
        for c, reason in hopeless:
            abort(s, c, reason)
        _retention(s)
    if store is None:
        return
    for cid in ready:
        commit_ready(factory, store, cid)
    _delete_objects(factory, store)


def _lost_nodes(session: Session, attempt: Attempt) -> list[str]:
    """The names of the attempt's unreachable nodes that still hold a part of it."""
    return list(session.scalars(
        select(Node.name).join(AttemptPart, AttemptPart.node_id == Node.id)
        .where(AttemptPart.attempt_id == attempt.id, AttemptPart.released_at.is_(None),
               Node.state.in_(NODE_UNREACHABLE)).order_by(Node.name)))


def _retention(session: Session) -> None:
    for job in session.scalars(select(Job).where(Job.id.in_(
        select(Checkpoint.job_id).where(Checkpoint.state == "committed").distinct()
    ))):
        keep = _keep_last(job)
        for c, _number in usable_by_lineage(session, job.id)[keep:]:  # unusable ones do not count
            transition(session, c, "deleted", f"checkpoint of step {c.step} deleted (keep_last={keep})")


def _delete_objects(factory: sessionmaker[Session], store: ObjectStore) -> None:
    with session_scope(factory) as s:
        doomed = [
            (c.id, checkpoint_prefix(c.job_id, c.step, a.number) + "/")
            for c, a in s.execute(
                select(Checkpoint, Attempt).join(Attempt, Attempt.id == Checkpoint.attempt_id).where(
                    Checkpoint.state.in_(COLLECTED), Checkpoint.objects_deleted.is_(False)
                ).limit(100)
            )
        ]
    for cid, prefix in doomed:
        try:
            for key in store.list_keys(prefix):  # type: ignore[attr-defined]
                store.delete(key)
        except Exception as exc:
            log.warning("checkpoint objects not deleted yet", checkpoint_id=str(cid), error=repr(exc))
            continue
        with session_scope(factory) as s:
            s.execute(update(Checkpoint).where(Checkpoint.id == cid).values(objects_deleted=True))
