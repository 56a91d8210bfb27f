"""Nodes: registration, credentials, heartbeats (desired state), liveness."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.clock import now
from control_plane.db import reload
from control_plane.errors import InvalidState, NotFound, Unauthorized
from control_plane.models import Attempt, AttemptNode, Gpu, GpuLease, Job, Node
from control_plane.schemas.agent import (
    AssignmentRef,
    HeartbeatRequest,
    KnownAssignment,
    LaunchSpec,
    RegisterRequest,
)
from control_plane.services import attempts, events
from control_plane.services.fencing import lock_attempt

# An attempt part whose processes vanished without an exit report for this long is failed.
VANISHED_AFTER_S = 10.0


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def register(session: Session, req: RegisterRequest) -> tuple[Node, str]:
    """Register (or re-register) a node by name; returns it and a fresh node credential."""
    token = "tyn_" + secrets.token_urlsafe(32)
    node = session.scalar(select(Node).where(Node.name == req.name).with_for_update())
    t = now()
    if node is None:
        node = Node(
            id=uuid.uuid4(),
            name=req.name,
            address=req.address,
            state="ready",
            schedulable=True,
            labels=req.labels,
            token_hash=hash_token(token),
            agent_version=req.agent_version,
            last_heartbeat_at=t,
            registered_at=t,
        )
        session.add(node)
        session.flush()
        events.record(session, "node.registered", f"node {req.name} registered with {len(req.gpus)} GPUs",
                      node_id=node.id, address=req.address)
    else:
        node.address = req.address
        node.labels = req.labels or node.labels
        node.token_hash = hash_token(token)
        node.agent_version = req.agent_version
        node.agent_instance = None
        node.heartbeat_seq = 0
        if node.state == "removed":
            # Back after an operator removed it: its old attempts were released then, so its agent
            # gets none of them assigned and stops whatever of them still runs.
            node.state, node.schedulable, node.last_heartbeat_at = "ready", True, t
            events.record(session, "node.rejoined", f"removed node {req.name} registered again", node_id=node.id)
        else:
            events.record(session, "node.reregistered", f"node {req.name} registered again", node_id=node.id)
    _sync_gpus(session, node, req)
    session.commit()
    return node, token


def _sync_gpus(session: Session, node: Node, req: RegisterRequest) -> None:
    have = {g.index: g for g in session.scalars(select(Gpu).where(Gpu.node_id == node.id))}
    for info in req.gpus:
        g = have.pop(info.index, None)
        if g is None:
            session.add(Gpu(node_id=node.id, index=info.index, uuid=info.uuid, kind=info.kind,
                            memory_mb=info.memory_mb))
        else:
            g.uuid, g.kind, g.memory_mb = info.uuid, info.kind, info.memory_mb
    for g in have.values():
        # A GPU that disappeared while leased stays until its lease is released.
        leased = session.scalar(select(GpuLease.id).where(GpuLease.gpu_id == g.id, GpuLease.released_at.is_(None)))
        if leased is None:
            session.delete(g)


def authenticate(session: Session, token: str) -> Node:
    node = session.scalar(select(Node).where(Node.token_hash == hash_token(token)))
    if node is None or node.state == "removed":
        raise Unauthorized("unknown node credential; register the agent again")
    return node


def heartbeat(
    session: Session, node: Node, req: HeartbeatRequest, storage: dict[str, object] | None = None
) -> list[LaunchSpec]:
    """Record liveness, confirm stopped attempts, and return the node's desired attempts."""
    node = session.get(Node, node.id, with_for_update=True) or node
    if node.agent_instance == req.agent_instance and req.seq <= node.heartbeat_seq:
        # A delayed or duplicated heartbeat: it carries older truth than what we have.
        return assignments(session, node, storage)
    node.agent_instance = req.agent_instance
    node.heartbeat_seq = req.seq
    node.last_heartbeat_at = now()
    if node.state == "lost":
        node.state = "ready"
        events.record(session, "node.returned", f"node {node.name} is back", node_id=node.id)
    alive = {a.attempt_id for a in req.attempts if a.processes_alive}
    _confirm_stopped(session, node, alive)
    session.flush()
    return assignments(session, node, storage)


def _confirm_stopped(session: Session, node: Node, alive: set[str]) -> None:
    candidates = session.execute(
        select(AttemptNode.id, AttemptNode.attempt_id)
        .where(AttemptNode.node_id == node.id, AttemptNode.released_at.is_(None))
        .order_by(AttemptNode.attempt_id)
    ).all()
    for part_id, attempt_id in candidates:
        if str(attempt_id) in alive:
            continue
        locked = lock_attempt(session, attempt_id)  # job, then attempt: see lock_attempt
        assert locked is not None
        job, attempt = locked
        part = reload(session, select(AttemptNode).where(AttemptNode.id == part_id).with_for_update()).one()
        if part.released_at is not None:
            continue
        if part.desired == "stop" or part.state in ("exited", "stopped"):
            attempts.release_part(session, part)
        elif part.state in ("launching", "running") and part.reported_at is not None:
            silent = (now() - part.reported_at).total_seconds()
            if silent > VANISHED_AFTER_S:
                attempts.fail_attempt(
                    session, job, attempt,
                    f"processes of node rank {part.node_rank} on {node.name} vanished without an exit report",
                    node_id=node.id,
                )
                attempts.release_part(session, part)


def assignments(session: Session, node: Node, storage: dict[str, object] | None) -> list[LaunchSpec]:
    specs = []
    for attempt, part, job in attempts.desired_for_node(session, node):
        specs.append(
            LaunchSpec(
                job_id=str(job.id),
                job_name=job.name,
                attempt_id=str(attempt.id),
                attempt_number=attempt.number,
                fencing_token=attempt.fencing_token,
                node_rank=part.node_rank,
                nnodes=job.num_nodes,
                nproc_per_node=job.gpus_per_node,
                gpu_indices=list(part.gpu_indices),
                rdzv_host=attempt.rdzv_host,
                rdzv_port=attempt.rdzv_port,
                entrypoint=job.entrypoint,
                args=list(job.args),
                env=dict(job.env),
                checkpoint=dict(job.checkpoint),
                restore_from=attempt.restore_manifest,
                storage={**(storage or {}), "prefix": f"jobs/{job.id}/checkpoints"},
            )
        )
    for spec in specs:
        spec.version = spec_version(spec)
    return specs


# The part of LaunchSpec.storage that is per attempt; the rest (credentials) goes to an agent once,
# in the RegisterResponse.
SPEC_STORAGE_KEYS = ("prefix",)


def spec_version(spec: LaunchSpec) -> str:
    """The etag of a launch spec: a digest of its content, credentials excluded, so it changes when
    and only when what the agent would launch changes."""
    body = spec.model_copy(update={"storage": _spec_storage(spec), "version": ""})
    return hashlib.sha256(body.model_dump_json().encode()).hexdigest()[:16]


def _spec_storage(spec: LaunchSpec) -> dict[str, object]:
    return {k: v for k, v in spec.storage.items() if k in SPEC_STORAGE_KEYS}


def for_agent(
    specs: list[LaunchSpec], known: list[KnownAssignment] | None
) -> tuple[list[LaunchSpec], list[AssignmentRef]]:
    """What a heartbeat answers, given the node's desired specs and those its agent holds.

    An old agent (``known`` is None) gets every spec in full, credentials included. Otherwise only
    new or changed specs go in full, without credentials; every known one comes as a reference:
    'run' when it is still assigned at that version, 'stop' when it is no longer assigned. So the
    steady-state answer grows with the node's own attempts, not with the job's size or arguments.
    """
    if known is None:
        return specs, []
    held = {k.attempt_id: k.version for k in known}
    full: list[LaunchSpec] = []
    refs: list[AssignmentRef] = []
    for spec in specs:
        version = held.pop(spec.attempt_id, None)
        if version is not None and version == spec.version:
            refs.append(AssignmentRef(attempt_id=spec.attempt_id, desired="run", version=version))
        else:
            full.append(spec.model_copy(update={"storage": _spec_storage(spec)}))
    refs.extend(AssignmentRef(attempt_id=a, desired="stop", version=v) for a, v in sorted(held.items()))
    return full, refs


def mark_lost_nodes(session: Session, *, timeout_s: float, not_before: datetime) -> list[Node]:
    """Declare nodes lost after missed heartbeats and fail the attempts running on them.

    Their leases stay held: the GPUs are not given to anyone until the agent comes back and
    confirms its stale workers are stopped, or an operator removes the node.
    """
    t = now()
    if t < not_before:
        return []
    cutoff = t - timedelta(seconds=timeout_s)
    lost = session.scalars(
        select(Node)
        .where(Node.state == "ready", Node.last_heartbeat_at < cutoff)
        .with_for_update(skip_locked=True)
    ).all()
    for node in lost:
        node.state = "lost"
        events.record(session, "node.lost", f"node {node.name} missed heartbeats for {timeout_s:g}s",
                      node_id=node.id)
        attempt_ids = session.scalars(
            select(Attempt.id)
            .join(AttemptNode, AttemptNode.attempt_id == Attempt.id)
            .where(AttemptNode.node_id == node.id, AttemptNode.released_at.is_(None), Attempt.state != "ended")
            .order_by(Attempt.id)
        ).all()
        for attempt_id in attempt_ids:
            locked = lock_attempt(session, attempt_id)
            assert locked is not None
            job, attempt = locked
            if attempt.outcome is None:
                attempts.fail_attempt(session, job, attempt, f"node {node.name} lost", node_id=node.id)
            elif attempt.outcome == "failed" and attempt.failed_node_id != node.id:
                # The workers of the other nodes saw their peer vanish and exited first, so the
                # attempt failed before this node was declared lost: the lost node is the cause.
                attempt.failed_node_id = node.id
                attempt.end_reason = f"node {node.name} lost ({attempt.end_reason})"
                events.record(session, "attempt.blame", f"attempt {attempt.number}: node {node.name} was lost",
                              job_id=job.id, attempt_id=attempt.id, node_id=node.id)
    return list(lost)


def remove_node(session: Session, node_id: uuid.UUID) -> Node:
    """An operator removes a node: its credential stops working and, if it was lost, its leases are
    released (the operator vouches that its processes are gone). A node that is not lost and still
    runs or stops an attempt is refused: its processes exist, and its GPUs must not be given away."""
    node = session.get(Node, node_id, with_for_update=True)
    if node is None or node.state == "removed":
        raise NotFound(f"node {node_id} does not exist")
    parts = session.execute(
        select(AttemptNode, Attempt, Job)
        .join(Attempt, Attempt.id == AttemptNode.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .where(AttemptNode.node_id == node.id, AttemptNode.released_at.is_(None))
        .order_by(Attempt.id)
    ).all()
    if parts and node.state != "lost":
        running = ", ".join(sorted({f"attempt {a.number} of job {j.name} ({j.id})" for _, a, j in parts}))
        raise InvalidState(
            f"node {node.name} is {node.state} and still holds {running}; cancel those jobs or wait until "
            "they end (a lost node can be removed at any time)"
        )
    node.state = "removed"
    node.schedulable = False
    node.token_hash = hash_token(secrets.token_urlsafe(32))  # its credential stops working
    events.record(session, "node.removed", f"node {node.name} removed by an operator", node_id=node.id,
                  released_parts=len(parts))
    for part, attempt, _ in parts:
        locked = lock_attempt(session, attempt.id)
        assert locked is not None
        job, attempt = locked
        if attempt.outcome is None:
            attempts.fail_attempt(session, job, attempt, f"node {node.name} removed", node_id=node.id)
        attempts.release_part(session, part)
    session.commit()
    return node


def get_node(session: Session, node_id: uuid.UUID) -> Node:
    node = session.get(Node, node_id)
    if node is None:
        raise NotFound(f"node {node_id} does not exist")
    return node


def list_nodes(session: Session) -> list[Node]:
    return list(session.scalars(select(Node).where(Node.state != "removed").order_by(Node.name)))


def active_leases(session: Session, node_ids: list[uuid.UUID] | None = None) -> dict[uuid.UUID, GpuLease]:
    stmt = select(GpuLease).where(GpuLease.released_at.is_(None))
    if node_ids is not None:
        stmt = stmt.where(GpuLease.node_id.in_(node_ids))
    return {lease.gpu_id: lease for lease in session.scalars(stmt)}


# -- Cordon, drain, uncordon, operator labels ---------------------------------------------------
# None of these stops anything: a cordoned or draining node gets no new work and its running jobs
# finish (no preemption, ever). The scheduler reads only ``schedulable``; ``draining`` says why.

SCHEDULABLE, CORDONED, DRAINING, DRAINED = "schedulable", "cordoned", "draining", "drained"


def scheduling_state(node: Node, busy: bool) -> str:
    """How the scheduler treats the node; ``busy``: some attempt still holds GPUs on it."""
    if node.schedulable:
        return SCHEDULABLE
    if node.draining:
        return DRAINING if busy else DRAINED
    return CORDONED


def _for_update(session: Session, node_id: uuid.UUID) -> Node:
    node = session.get(Node, node_id, with_for_update=True)
    if node is None:
        raise NotFound(f"node {node_id} does not exist")
    if node.state == "removed":
        raise InvalidState(f"node {node.name} was removed")
    return node


def _set_scheduling(session: Session, node_id: uuid.UUID, *, schedulable: bool, draining: bool,
                    kind: str, message: str) -> Node:
    node = _for_update(session, node_id)
    if (node.schedulable, node.draining) != (schedulable, draining):
        node.schedulable, node.draining = schedulable, draining
        events.record(session, kind, f"node {node.name} {message}", node_id=node.id)
    session.commit()
    return node


def cordon(session: Session, node_id: uuid.UUID) -> Node:
    """No new work on the node; what runs there keeps running. Idempotent."""
    return _set_scheduling(session, node_id, schedulable=False, draining=False, kind="node.cordoned",
                           message="cordoned: no new work")


def drain(session: Session, node_id: uuid.UUID) -> Node:
    """No new work; running jobs finish, then the node shows as drained. Idempotent."""
    return _set_scheduling(session, node_id, schedulable=False, draining=True, kind="node.draining",
                           message="draining: no new work, running jobs finish")


def uncordon(session: Session, node_id: uuid.UUID) -> Node:
    """The node takes new work again. Idempotent."""
    return _set_scheduling(session, node_id, schedulable=True, draining=False, kind="node.uncordoned",
                           message="uncordoned: takes new work")


def set_labels(session: Session, node_id: uuid.UUID, labels: dict[str, str]) -> Node:
    """Replace the operator's labels of the node; they win over the labels its agent reports."""
    node = _for_update(session, node_id)
    node.label_overrides = dict(labels)
    events.record(session, "node.labels", f"node {node.name} labels set by the operator", node_id=node.id,
                  labels=dict(labels))
    session.commit()
    return node
