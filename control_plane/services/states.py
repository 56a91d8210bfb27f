"""The state machines of jobs, attempts, attempt parts, nodes, checkpoints and upload slots, written
down once.

Each entity has a transition table (``JOB``, ``ATTEMPT``, ``PART``, ``NODE``, ``CHECKPOINT``,
``UPLOAD_SLOT``): for every state,
the states it may move to and, for every state that is not terminal, the mechanism that gets an
entity out of it without anyone having to act (``Exit``): a loop that acts after a timeout setting,
or a message that always comes. tests/control_plane/test_state_tables.py walks the tables and
checks that every non-terminal state has such an exit and that each named setting exists. The
state groups (``JOB_WAITING``, ``ATTEMPT_LIVE``, ...) are the only spelling of those sets.

Each entity has one mutator (``set_job_state``, ``set_attempt_state``, ``advance_part``,
``set_node_state``, ``set_checkpoint_state``, ``move_upload_slots``): the only writers of its
``state`` column. A mutator
refuses a transition the table does not allow and records an event. (A checkpoint's commit point,
``pending -> committed``, is one conditional UPDATE in services/checkpoints/checkpoints.py ``commit_ready``,
checked against ``CHECKPOINT``.) docs/architecture.md, "Job and attempt states", shows the tables
(rendered by ``render_markdown``; the test checks the doc against it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Row, update
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.errors import InvalidState
from control_plane.models import ACTIVE_ATTEMPT_STATES, Attempt, AttemptPart, Checkpoint, Job, Node, UploadSlot
from control_plane.services import events


@dataclass(frozen=True)
class Exit:
    """How an entity leaves a state on its own.

    ``settings``: the timeouts/periods (names of ``Settings`` fields) after which a loop acts;
    ``message``: a message that always comes (from the agent, a loop, a user) and moves it on.
    ``operator``: an operator action that also ends the state (never the only exit of a job state).
    """

    how: str
    settings: tuple[str, ...] = ()
    message: str | None = None
    operator: str | None = None


@dataclass(frozen=True)
class State:
    to: frozenset[str]
    exit: Exit | None = None  # None only for terminal states


def _s(*to: str, exit: Exit | None = None) -> State:
    return State(frozenset(to), exit)


# -- Jobs ---------------------------------------------------------------------------------------

JOB: dict[str, State] = {
    "queued": _s("starting", "cancelled", "failed", exit=Exit(
        "the scheduler loop starts it when it fits; the job view's waiting_for says what it waits for",
        settings=("scheduler_interval_s",), message="DELETE /v1/jobs/{id} (cancel)")),
    "starting": _s("running", "succeeded", "recovering", "failed", "cancelling", exit=Exit(
        "every worker reports running, or a part not launching within the launch timeout fails the "
        "attempt, or its node is lost, or the time limit ends it",
        settings=("attempt_launch_timeout_s", "node_lost_timeout_s", "limits_interval_s"),
        message="attempt status report")),
    "running": _s("succeeded", "recovering", "failed", "cancelling", exit=Exit(
        "the workers exit (status reports), a node is lost, the time limit ends it, or the watchdog fails "
        "its attempt as hung (its step stopped advancing) or as not started (no first step)",
        settings=("node_lost_timeout_s", "limits_interval_s", "hang_timeout_min_s", "startup_timeout_s",
                  "watchdog_interval_s"),
        message="attempt status report")),
    "recovering": _s("starting", "failed", "cancelling", "cancelled", exit=Exit(
        "the scheduler loop places the next attempt, or fails the job when the cluster cannot hold it "
        "without its twice-failed nodes; waiting_for says what it waits for",
        settings=("scheduler_interval_s",), message="DELETE /v1/jobs/{id} (cancel)")),
    "cancelling": _s("cancelled", exit=Exit(
        "each node confirms its workers stopped (final status report or heartbeat); a part on a lost "
        "node counts as stopped for the job (its leases stay held on the node until it returns or is "
        "removed); it is cancelled right after the commit of the release that ends its attempt, or by "
        "the monitor loop's sweep should the control plane die in between",
        settings=("node_lost_timeout_s", "monitor_interval_s"), message="heartbeat")),
    "succeeded": _s(),
    "failed": _s(),
    "cancelled": _s(),
}

JOB_TERMINAL = frozenset(s for s, st in JOB.items() if not st.to)
JOB_WAITING = ("queued", "recovering")
"""In the queue: waiting for the scheduler."""
JOB_ACTIVE = ("starting", "running")
"""An attempt is placed and should be running."""
JOB_STATES = tuple(JOB)


# -- Attempts -----------------------------------------------------------------------------------

ATTEMPT: dict[str, State] = {
    "starting": _s("running", "stopping", exit=Exit(
        "every worker reports running, or a part not launching within the launch timeout (or on a "
        "lost node, or past the time limit) fails it",
        settings=("attempt_launch_timeout_s", "node_lost_timeout_s", "limits_interval_s"),
        message="attempt status report")),
    "running": _s("stopping", exit=Exit(
        "its workers exit, its node is lost, the time limit ends it, or its step does not advance within "
        "its hang timeout (derived from its step time, at least hang_timeout_min_s; the watchdog loop fails "
        "it as hung, naming the ranks that stopped reporting), or no rank reports a first step within "
        "startup_timeout_s (failed as not started, quoting each rank's last stderr lines)",
        settings=("node_lost_timeout_s", "limits_interval_s", "hang_timeout_min_s", "startup_timeout_s",
                  "watchdog_interval_s"),
        message="attempt status report")),
    "stopping": _s("ended", exit=Exit(
        "each node confirms its processes gone (its final status report, or the heartbeat that stops "
        "listing it), and the release that completes the gang ends it in the same transaction (never "
        "an attempt that holds no part and is not ended; a part's GPU leases may have passed to its job's "
        "next attempt meanwhile, which is not released before it); a lost node's part waits for the "
        "node to return",
        settings=("node_lost_timeout_s",), message="attempt status report, heartbeat",
        operator="DELETE /v1/nodes/{id}")),
    "ended": _s(),
}

ATTEMPT_LIVE = ("starting", "running")
"""Decided to run: its nodes are told to run it."""
ATTEMPT_HOLDING = ACTIVE_ATTEMPT_STATES
"""Still holds GPUs or its rendezvous port (``starting``, ``running``, ``stopping``)."""
assert set(ATTEMPT_HOLDING) == set(ATTEMPT) - {"ended"}


# -- Attempt parts (one node's share of an attempt) ---------------------------------------------

PART: dict[str, State] = {
    # parked: told to stop before the agent's first report reached us (it parks what runs).
    "assigned": _s("launching", "running", "parked", "exited", "stopped", "gone", exit=Exit(
        "the agent reports it launching at its next heartbeat (a part given the GPUs of a stopping part once "
        "that part's processes are gone); a part still assigned after the launch timeout (for such a part, "
        "counted once that part is released) fails its attempt (the maintenance step of the monitor loop)",
        settings=("attempt_launch_timeout_s", "monitor_interval_s"), message="attempt status report")),
    "launching": _s("running", "parked", "exited", "stopped", "gone", exit=Exit(
        "the agent reports its workers running or exited; a lost node fails it",
        settings=("node_lost_timeout_s",), message="attempt status report")),
    "running": _s("parked", "exited", "stopped", "gone", exit=Exit(
        "the agent reports torchrun's exit; a lost node fails it",
        settings=("node_lost_timeout_s",), message="attempt status report")),
    # A restartable job's healthy part told to stop: its workers stay alive, its leases held, until a
    # scheduling pass hands them over to the next attempt (``gone`` by the handed_over transition,
    # services/runs/handover.py) or its agent's handover timeout stops them as usual.
    "parked": _s("exited", "stopped", "gone", exit=Exit(
        "a scheduling pass that places the job's next attempt on its exact GPUs hands it over (gone); else its "
        "agent stops the workers after its handover timeout and reports it stopped; a lost node fails it",
        settings=("scheduler_interval_s", "node_lost_timeout_s"), message="attempt status report")),
    "exited": _s("gone", exit=Exit(
        "its final status report saying no process is left releases it, or else the heartbeat that "
        "no longer lists it", settings=("heartbeat_interval_s",), message="attempt status report, heartbeat")),
    "stopped": _s("gone", exit=Exit(
        "its final status report saying no process is left releases it, or else the heartbeat that "
        "no longer lists it", settings=("heartbeat_interval_s",), message="attempt status report, heartbeat")),
    "gone": _s(),
}

PART_ORDER = {"assigned": 0, "launching": 1, "running": 2, "parked": 3, "exited": 4, "stopped": 4, "gone": 5}
"""Reports merge monotonically: a part's state only moves to a higher rank."""
PART_UNLAUNCHED = ("assigned",)
PART_STARTED = ("launching", "running")
PART_DONE = ("exited", "stopped")
PART_PARKED = ("parked",)
"""Workers alive and waiting for the next attempt, leases held (a restartable job's healthy part)."""


# -- Nodes --------------------------------------------------------------------------------------

NODE: dict[str, State] = {
    "ready": _s("lost", "removed", exit=Exit(
        "the monitor loop declares it lost after missed heartbeats",
        settings=("node_lost_timeout_s", "monitor_interval_s"), message="heartbeat")),
    # Lost is the one state only the node or an operator ends: its workers may still run (a
    # partition), so its GPUs are never given away on a timeout. Its jobs do not wait for it.
    "lost": _s("ready", "removed", exit=Exit(
        "its agent's heartbeat brings it back; an operator who knows it is gone removes it",
        message="heartbeat", operator="DELETE /v1/nodes/{id}")),
    "removed": _s("ready", exit=Exit("its agent registering again brings it back (empty)",
                                     message="register", operator="none needed")),
}

NODE_WAITS_FOR_OPERATOR = frozenset({"lost", "removed"})
NODE_UNREACHABLE = ("lost", "removed")
"""Nodes nobody waits for: a cancel ends without their confirmation (their leases stay held)."""
"""Node states with no timeout exit, on purpose (see above); no job state is in this position."""


# -- Checkpoints (two-phase commit: services/checkpoints/checkpoints.py, docs/architecture.md) ---------------

CHECKPOINT: dict[str, State] = {
    "pending": _s("committed", "aborted", exit=Exit(
        "the last shard report commits it (phase 2); the maintenance loop commits a complete one or "
        "aborts it when a rank could not save, its attempt ended first, a more recent checkpoint of "
        "the lineage committed first, or it is still incomplete after the pending timeout",
        settings=("checkpoint_pending_timeout_s", "checkpoint_maintenance_interval_s"),
        message="shard report")),
    # The usable state: a checkpoint rests here while it is among the newest keep_last of its job.
    "committed": _s("unusable", "deleted", exit=Exit(
        "a restore that finds it bad (a checkpoint.fallback event) makes it unusable; retention (the "
        "maintenance loop) deletes it once keep_last more recent usable ones of the lineage exist",
        settings=("checkpoint_maintenance_interval_s",), message="worker event checkpoint.fallback")),
    "unusable": _s(),
    "aborted": _s(),
    "deleted": _s(),
}

CHECKPOINT_TERMINAL = frozenset(s for s, st in CHECKPOINT.items() if not st.to)
CHECKPOINT_COLLECTED = ("unusable", "aborted", "deleted")
"""Checkpoint states whose objects are deleted from storage (every terminal one)."""
assert set(CHECKPOINT_COLLECTED) == CHECKPOINT_TERMINAL


# -- Upload slots (leases on the shared links: services/checkpoints/upload_slots.py, docs/architecture.md) ---

UPLOAD_SLOT: dict[str, State] = {
    "waiting": _s("granted", "released", "expired", exit=Exit(
        "a grant pass (run or asked for by every slot request and release, on any replica) grants it, "
        "oldest first, once the limits admit it; its worker withdraws it (release) or stops asking and it "
        "expires a lease later (renewed while its long poll is held); it expires at once when its attempt "
        "ends or stops being the job's current one",
        settings=("upload_slot_poll_s", "upload_slot_ttl_s", "checkpoint_maintenance_interval_s"),
        message="upload-slot request (long poll) or release")),
    "granted": _s("released", "expired", exit=Exit(
        "its worker releases it when the upload ends (or fails); one not renewed within the lease (a crashed "
        "holder), or of an attempt that ended or is no longer the job's current one, is reclaimed by the next "
        "grant pass or the maintenance loop",
        settings=("upload_slot_ttl_s", "checkpoint_maintenance_interval_s"), message="upload-slot release")),
    "released": _s(),
    "expired": _s(),
}

UPLOAD_SLOT_OPEN = ("waiting", "granted")
"""Upload-slot states that hold a place: in the queue, or in the limits."""


# -- Mutators -----------------------------------------------------------------------------------

def _check(table: dict[str, State], what: str, ident: object, src: str, dst: str) -> None:
    if dst not in table:
        raise ValueError(f"unknown {what} state {dst!r}")
    if dst not in table[src].to:
        raise InvalidState(f"{what} {ident} cannot go from {src} to {dst}")


def can_transition(src: str, dst: str) -> bool:
    """Whether the job state machine allows ``src`` -> ``dst``."""
    return dst in JOB.get(src, State(frozenset())).to


def set_job_state(session: Session, job: Job, new_state: str, reason: str, *, batch: events.Batch | None = None,
                  **data: Any) -> bool:
    """Move ``job`` to ``new_state`` and record the event; the only writer of ``Job.state``.

    Returns False (and changes nothing) when the job is already in ``new_state``; raises
    InvalidState for a transition the state machine does not allow. ``batch``: the event goes there
    (the caller writes it with the others of a bulk change).
    """
    if job.state == new_state:
        return False
    _check(JOB, "job", job.id, job.state, new_state)
    old = job.state
    job.state = new_state
    t = now()
    job.updated_at = t
    if new_state == "running" and job.started_at is None:
        job.started_at = t
    if new_state in JOB_TERMINAL:
        job.ended_at = t
        if new_state != "succeeded":
            job.end_reason = reason
    if batch is not None:
        batch.add(f"job.{new_state}", reason, job_id=job.id, from_state=old, to_state=new_state, **data)
    else:
        events.record(
            session, f"job.{new_state}", reason, job_id=job.id, from_state=old, to_state=new_state, **data
        )
    return True


def set_attempt_state(session: Session, attempt: Attempt, new_state: str, reason: str, *,
                      kind: str | None = None, **data: Any) -> bool:
    """Move ``attempt`` to ``new_state`` and record the event (``kind``, default
    ``attempt.<state>``); the only writer of ``Attempt.state``. False when already there."""
    if attempt.state == new_state:
        return False
    _check(ATTEMPT, "attempt", attempt.id, attempt.state, new_state)
    old = attempt.state
    attempt.state = new_state
    t = now()
    if new_state == "ended":
        attempt.ended_at = t
    events.record(session, kind or f"attempt.{new_state}", reason, job_id=attempt.job_id, attempt_id=attempt.id,
                  from_state=old, to_state=new_state, **data)
    return True


def advance_part(session: Session, part: AttemptPart, new_state: str, *, job_id: uuid.UUID | None = None,
                 kind: str | None = None, **data: Any) -> bool:
    """Move a node's part of an attempt forward to ``new_state``; the only writer of
    ``AttemptPart.state``. Reports merge monotonically: a state that is not higher than the
    current one (``PART_ORDER``) changes nothing and returns False. ``kind``: the event (default
    ``part.<state>``), e.g. ``part.handed_over`` for a parked part's move to ``gone``."""
    if new_state not in PART:
        raise ValueError(f"unknown attempt part state {new_state!r}")
    if PART_ORDER[new_state] <= PART_ORDER[part.state]:
        return False
    _check(PART, "attempt part", part.id, part.state, new_state)
    old = part.state
    part.state = new_state
    events.record(session, kind or f"part.{new_state}", f"node rank {part.node_rank}: {old} -> {new_state}",
                  job_id=job_id, attempt_id=part.attempt_id, node_id=part.node_id,
                  from_state=old, to_state=new_state, **data)
    return True


def set_node_state(session: Session, node: Node, new_state: str, reason: str, *, kind: str,
                   **data: Any) -> bool:
    """Move ``node`` to ``new_state`` and record the event ``kind``; the only writer of
    ``Node.state``. Removing makes it unschedulable; coming back from removal makes it schedulable
    and not draining (one write, so ck_nodes_drain_unschedulable always holds)."""
    if node.state == new_state:
        return False
    _check(NODE, "node", node.name, node.state, new_state)
    old = node.state
    node.state = new_state
    if new_state == "removed":
        node.schedulable = False
    elif old == "removed":
        node.schedulable, node.draining = True, False
    events.record(session, kind, reason, node_id=node.id, from_state=old, to_state=new_state, **data)
    return True


def set_checkpoint_state(session: Session, ckpt: Checkpoint, new_state: str, message: str, *,
                         reason: str | None = None, **data: Any) -> bool:
    """Move ``ckpt`` to ``new_state`` and record the event ``checkpoint.<state>``; the only writer
    of ``Checkpoint.state`` (but for commit_ready's conditional commit). A transition the table does
    not allow (a late abort of a committed checkpoint, a demotion of a deleted one) changes nothing
    and returns False: checkpoint facts arrive late and out of order, and none of them is an error."""
    if new_state not in CHECKPOINT:
        raise ValueError(f"unknown checkpoint state {new_state!r}")
    if new_state not in CHECKPOINT.get(ckpt.state, State(frozenset())).to:
        return False
    old = ckpt.state
    ckpt.state = new_state
    if reason is not None:
        ckpt.reason = reason
    events.record(session, f"checkpoint.{new_state}", message, job_id=ckpt.job_id, attempt_id=ckpt.attempt_id,
                  step=ckpt.step, checkpoint_id=str(ckpt.id), from_state=old, to_state=new_state, **data)
    return True


def move_upload_slots(session: Session, where: ColumnElement[bool], new_state: str,
                      **values: Any) -> list[Row[Any]]:
    """Move every upload slot matching ``where`` to ``new_state`` in one conditional UPDATE (a
    checkpoint burst moves hundreds at once), writing ``values`` with it; the only writer of
    ``UploadSlot.state``. Only slots in a state the table lets reach ``new_state`` move, so a slot
    another transaction moved first is left alone. Returns (id, job_id, attempt_id, node_id, rank,
    step) of each slot moved. Records no event: the grant pass records what deserves one."""
    if new_state not in UPLOAD_SLOT:
        raise ValueError(f"unknown upload slot state {new_state!r}")
    sources = sorted(s for s, spec in UPLOAD_SLOT.items() if new_state in spec.to)
    return list(session.execute(
        update(UploadSlot).where(where, UploadSlot.state.in_(sources)).values(state=new_state, **values)
        .returning(UploadSlot.id, UploadSlot.job_id, UploadSlot.attempt_id, UploadSlot.node_id, UploadSlot.rank,
                   UploadSlot.step)
        .execution_options(synchronize_session=False)
    ))


# -- The tables as docs/architecture.md shows them ----------------------------------------------

TABLES: dict[str, dict[str, State]] = {"job": JOB, "attempt": ATTEMPT, "part": PART, "node": NODE,
                                       "checkpoint": CHECKPOINT, "upload_slot": UPLOAD_SLOT}
DOC_BEGIN = "<!-- state tables: begin (services/states.py render_markdown; checked by test_state_tables.py) -->"
DOC_END = "<!-- state tables: end -->"


def render_markdown() -> str:
    """Every table as a compact list per entity: each state, where it may go, and its exit."""
    lines = [DOC_BEGIN]
    for entity, table in TABLES.items():
        lines += ["", f"**{entity}**", ""]
        for state, spec in table.items():
            if not spec.to:
                lines.append(f"- `{state}`: terminal")
                continue
            assert spec.exit is not None
            how = [f"timeouts {', '.join(f'`{s}`' for s in spec.exit.settings)}"] if spec.exit.settings else []
            how += [f"message: {spec.exit.message}"] if spec.exit.message else []
            how += [f"operator: {spec.exit.operator}"] if spec.exit.operator else []
            lines.append(f"- `{state}` -> {', '.join(sorted(spec.to))}: {spec.exit.how} ({'; '.join(how)})")
    lines += ["", DOC_END]
    return "\n".join(lines)
