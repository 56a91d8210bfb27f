"""Nodes: registration, credentials, heartbeats (desired state), liveness."""

from __future__ import annotations

import secrets
import time
import uuid
from datetime import datetime, timedelta
from itertools import groupby

from sqlalchemy import Row, func, literal, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.authz import NODE_TOKEN_PREFIX, hash_token
from control_plane.clock import now
from control_plane.errors import InvalidState, NotFound, StaleAgent, Unauthorized
from control_plane.models import Attempt, AttemptPart, Gpu, GpuLease, Job, Node
from control_plane.services import events
from control_plane.services.access import join_tokens
from control_plane.services.cluster import specs
from control_plane.services.cluster.lost_policy import lost_grace_s
from control_plane.services.locks import lock_node, lock_part
from control_plane.services.runs import attempts
from control_plane.services.runs.fencing import lock_attempt
from control_plane.services.states import ATTEMPT_HOLDING, PART_DONE, PART_STARTED, set_node_state
from control_plane.settings import Settings
from trainyard.protocol.agent import (
    AssignmentRef,
    HeartbeatRequest,
    KnownAssignment,
    LaunchSpec,
    RegisterRequest,
)

# An attempt part whose processes vanished without an exit report for this long is failed.
VANISHED_AFTER_S = 10.0


def _node_token(node_id: uuid.UUID, epoch: int) -> str:
    """A fresh credential naming the node and its registration epoch (see authenticate)."""
    return f"{NODE_TOKEN_PREFIX}{node_id.hex}.{epoch}.{secrets.token_urlsafe(32)}"


def register(session: Session, req: RegisterRequest, credential: str, *,
             static_join_token: str = "") -> tuple[Node, str]:
    """Register (or re-register) a node by name; returns it and a fresh node credential.

    ``credential`` is the node's own current credential (an agent registering again), or a join
    token (services/access/join_tokens.py says which join token may register which name). A registered
    node is never handed to whoever asks: only its own credential, or a join token an operator
    bound to its name, re-claims it.

    Every registration is a new agent instance with the next epoch: the credential of any earlier
    one is refused from now on as stale (409 stale-agent, see authenticate), so the newer of two
    agents with one name wins and the older one is told to stop."""
    node = session.scalar(select(Node).where(Node.name == req.name).with_for_update(key_share=True))
    if credential.startswith(NODE_TOKEN_PREFIX):
        owner = session.scalar(select(Node).where(Node.token_hash == hash_token(credential)))
        if owner is None:
            _refuse_stale_instance(session, credential)
            raise Unauthorized("unknown node credential; register with a join token")
        if owner.name != req.name:
            raise Unauthorized(f"this credential is node {owner.name}'s, not {req.name}'s")
    else:
        join_tokens.authorize_registration(session, credential, req.name, node, static_token=static_join_token)
    t = now()
    instance = req.agent_instance  # None: the first heartbeat names it, as before
    if node is None:
        node_id = uuid.uuid4()
        token = _node_token(node_id, 1)
        node = Node(
            id=node_id,
            name=req.name,
            address=req.address,
            state="ready",
            schedulable=True,
            labels=req.labels,
            memory_port=req.memory_port,
            memory_tls=req.memory_tls,
            token_hash=hash_token(token),
            agent_version=req.agent_version,
            agent_instance=instance,
            agent_epoch=1,
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
        node.memory_port = req.memory_port
        node.memory_tls = req.memory_tls
        node.agent_epoch = (node.agent_epoch or 0) + 1
        token = _node_token(node.id, node.agent_epoch)
        node.token_hash = hash_token(token)
        node.agent_version = req.agent_version
        node.agent_instance = instance
        node.heartbeat_seq = 0
        if node.state == "removed":
            # Back after an operator removed it: its old attempts were released then, so its agent
            # gets none of them assigned and stops whatever of them still runs.
            # It comes back as a fresh node: schedulable, neither cordoned nor draining (both were
            # set at removal; set_node_state clears them together: ck_nodes_drain_unschedulable).
            node.last_heartbeat_at = t
            set_node_state(session, node, "ready", f"removed node {req.name} registered again", kind="node.rejoined")
        else:
            events.record(session, "node.reregistered", f"node {req.name} registered again", node_id=node.id,
                          agent_instance=instance, agent_epoch=node.agent_epoch)
    _sync_gpus(session, node, req)
    session.commit()
    forget_registered_count()
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


def authenticate(session: Session, token: str, *, lock: bool = False) -> Node:
    """The node a credential names. ``lock``: its row locked as ``lock_node`` does and loaded afresh
    (a heartbeat: one statement, not a read then a lock)."""
    stmt = select(Node).where(Node.token_hash == hash_token(token))
    if lock:
        stmt = stmt.with_for_update(key_share=True).execution_options(populate_existing=True)
    node = session.scalar(stmt)
    if node is None:
        _refuse_stale_instance(session, token)
    if node is None or node.state == "removed":
        raise Unauthorized("unknown node credential; register the agent again")
    return node


def _refuse_stale_instance(session: Session, token: str) -> None:
    """A credential of an earlier registration of a node that is still there: another agent instance
    registered as that node since. 409, not 401: the old instance must stop, not register again
    (two agents with one name would take the node from each other forever)."""
    try:
        node_hex, epoch_text, _ = token.removeprefix(NODE_TOKEN_PREFIX).split(".", 2)
        node_id, epoch = uuid.UUID(hex=node_hex), int(epoch_text)
    except ValueError:
        return
    node = session.get(Node, node_id)
    if node is None or node.state == "removed" or epoch >= (node.agent_epoch or 0):
        return
    raise StaleAgent(
        f"another agent instance registered as node {node.name} (epoch {node.agent_epoch}; this credential "
        f"is of epoch {epoch}): this agent must stop",
        node=node.name, agent_epoch=node.agent_epoch, credential_epoch=epoch,
    )


def heartbeat(session: Session, node: Node, req: HeartbeatRequest, arrived_at: datetime | None = None, *,
              locked: bool = False) -> Node:
    """Record liveness and confirm stopped attempts; returns the node as locked (what to answer is
    services/cluster/specs.py ``answer``). ``locked``: the caller locked and reloaded it
    (``authenticate(lock=True)``).

    ``arrived_at``: when the heartbeat reached this replica (control_plane/lanes.py stamps it before
    any queue), recorded as the node's last heartbeat, and the time it waited since as
    ``heartbeat_lag_s``: a heartbeat that waited here proves the node alive when it was sent, not
    when its turn came (lost_policy.py)."""
    if not locked:
        node = lock_node(session, node.id) or node  # reloaded: the seq checks below read the locked row
    if node.agent_instance == req.agent_instance and req.seq <= node.heartbeat_seq:
        # A delayed or duplicated heartbeat: it carries older truth than what we have. The agent's
        # retry of its latest one (the same seq: the first try's answer was lost) still proves it
        # alive now.
        if req.seq == node.heartbeat_seq and node.state == "ready":
            _stamp(node, arrived_at)
        return node
    node.agent_instance = req.agent_instance
    node.heartbeat_seq = req.seq
    _stamp(node, arrived_at)
    if node.state == "lost":
        set_node_state(session, node, "ready", f"node {node.name} is back", kind="node.returned")
    alive = {a.attempt_id for a in req.attempts if a.processes_alive}
    _confirm_stopped(session, node, alive, {a.attempt_id for a in req.attempts})
    session.flush()
    return node


def _stamp(node: Node, arrived_at: datetime | None) -> None:
    t = now()
    arrived = min(arrived_at, t) if arrived_at is not None else t
    if node.last_heartbeat_at is None or arrived > node.last_heartbeat_at:
        node.last_heartbeat_at = arrived  # never backwards: a retry may arrive before its first try is recorded
    lag = round((t - arrived).total_seconds(), 3)
    if node.heartbeat_lag_s != lag:
        node.heartbeat_lag_s = lag


def _confirm_stopped(session: Session, node: Node, alive: set[str], listed: set[str] | None = None) -> None:
    """Release the parts whose processes are gone. `listed`: every attempt the heartbeat names,
    also those whose processes are gone but whose final status is still on its way: the node
    holds them, so their absence of processes is no verdict ("vanished" is only ever decided for
    an attempt the node no longer lists at all).

    The releases lock each attempt, then its parts (attempts.release_parts), and the release of a
    gang's last part ends the attempt in this transaction; a cancelling job is finished after the
    heartbeat commits (attempts.finish_released). Only a vanished part, which fails its attempt,
    locks the job too (before its attempt: services/locks.py). Attempt by attempt, in the lock
    order (jobs, then attempts, by id): every lock of one attempt before any of the next."""
    listed = listed or set()
    candidates = session.execute(
        select(AttemptPart.id, AttemptPart.attempt_id, AttemptPart.desired, AttemptPart.state,
               AttemptPart.reported_at)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .where(AttemptPart.node_id == node.id, AttemptPart.released_at.is_(None))
        .order_by(Attempt.job_id, AttemptPart.attempt_id)  # the lock order: jobs, then attempts, by id
    ).all()
    for _, group in groupby(candidates, key=lambda c: c.attempt_id):
        ids = [part_id for c in group if (part_id := _to_release(session, node, c, alive, listed)) is not None]
        attempts.release_parts(session, ids)  # this attempt's locks, before any of the next one's


def _to_release(session: Session, node: Node, c: Row[uuid.UUID, uuid.UUID, str, str, datetime | None],
                alive: set[str], listed: set[str]) -> uuid.UUID | None:
    """The part of candidate ``c`` if its processes are confirmed gone (or vanished, which fails
    its attempt under the job and attempt locks), else None."""
    if str(c.attempt_id) in alive:
        return None
    # Read without the part's lock: a part's desired state only goes run -> stop and its state
    # only forward, so what qualifies it here still does once release_parts has locked it.
    if c.desired == "stop" or c.state in PART_DONE:
        return c.id
    if str(c.attempt_id) in listed:
        return None  # its final status is pending: it decides the attempt, not its absence
    if c.state in PART_STARTED and c.reported_at is not None \
            and (now() - c.reported_at).total_seconds() > VANISHED_AFTER_S:
        locked = lock_attempt(session, c.attempt_id)  # job, then attempt: see lock_attempt
        assert locked is not None
        job, attempt = locked
        part = lock_part(session, c.id)
        if part.released_at is None and part.desired == "run" and part.state in PART_STARTED:
            attempts.fail_attempt(
                session, job, attempt,
                f"processes of node rank {part.node_rank} on {node.name} vanished without an exit report",
                node_id=node.id, kind="node_lost",
            )
        return c.id
    return None


REGISTERED_TTL_S = 2.0
"""How long a replica reuses its count of registered nodes (tell_interval): a count per heartbeat was one
statement in eight of every heartbeat (bench/request_cost.py). A registration or removal on this
replica counts again at once; another replica's, within this long."""
_registered: dict[int, tuple[float, int]] = {}  # engine -> (when counted, monotonic; the count)


def registered_nodes(session: Session, *, fresh: bool = False) -> int:
    """Nodes whose agents heartbeat (or should): every node not removed (counted at most every
    REGISTERED_TTL_S by this replica unless ``fresh``)."""
    key, t = id(session.get_bind()), time.monotonic()
    cached = _registered.get(key)
    if not fresh and cached is not None and t - cached[0] < REGISTERED_TTL_S:
        return cached[1]
    count = int(session.scalar(select(func.count()).select_from(Node).where(Node.state != "removed")) or 0)
    _registered[key] = (t, count)
    return count


def forget_registered_count() -> None:
    """A node was registered or removed here: the next heartbeat counts again."""
    _registered.clear()


def tell_interval(session: Session, node: Node, settings: Settings) -> float:
    """The heartbeat interval to tell this node's agent now (it grows with the cluster, see
    Settings.interval_for), recorded on the node so that every replica's monitor gives the node the
    lost timeout of the interval it was told (mark_lost_nodes). Part of the caller's transaction."""
    interval = settings.interval_for(registered_nodes(session))
    told = interval if interval != settings.heartbeat_interval_s else None
    if node.heartbeat_interval_s != told:
        node.heartbeat_interval_s = told
    return interval


def node_id_of(token: str) -> str | None:
    """The node a credential names (``_node_token``), unverified: a long poll registers its wait under
    it before ``desired_change`` authenticates it."""
    try:
        return str(uuid.UUID(hex=token.removeprefix(NODE_TOKEN_PREFIX).split(".", 1)[0]))
    except ValueError:
        return None


def desired_change(factory: sessionmaker[Session], token: str, node_id: str,
                   known: list[KnownAssignment]) -> tuple[list[LaunchSpec], list[AssignmentRef]] | None:
    """Authenticate a long poll (``POST /v1/agent/wait``) and say whether the node's desired state
    differs from the specs its agent holds (``known``): a new or changed assignment, or a stop. The
    answer a heartbeat would give when it does (services/cluster/specs.py ``answer``), None when not. In
    its own short transaction, so the wait that follows holds no connection; every check
    authenticates again, so a wait that outlives its credential (another instance registered)
    answers nothing of the node."""
    session = factory()
    try:
        node = authenticate(session, token)
        if str(node.id) != node_id:
            raise Unauthorized("unknown node credential; register the agent again")
        full, refs = specs.answer(session, node.id, known, None)
        return (full, refs) if full or any(ref.desired == "stop" for ref in refs) else None
    finally:
        session.rollback()
        session.close()


def mark_lost_nodes(session: Session, *, timeout_s: float, not_before: datetime,
                    interval_s: float | None = None, local_oldest_s: float = 0.0) -> list[Node]:
    """Declare nodes lost after missed heartbeats and fail the attempts running on them.

    ``timeout_s`` is the lost timeout at the base interval ``interval_s``; a node told a longer
    interval (``Node.heartbeat_interval_s``, tell_interval) gets that much longer. Without
    ``interval_s`` every node gets ``timeout_s``. Every node gets longer still while heartbeats wait
    in a replica (lost_policy.py): ``local_oldest_s``, how long the oldest liveness request still
    unanswered on this replica has waited (read before the nodes are), and the largest
    ``heartbeat_lag_s`` any replica recorded within the timeout.

    Their leases stay held: the GPUs are not given to anyone until the agent comes back and
    confirms its stale workers are stopped, or an operator removes the node.
    """
    t = now()
    if t < not_before:
        return []
    # Lags recorded within the timeout (a heartbeat is recorded its lag after its arrival).
    recorded_at = Node.last_heartbeat_at + func.make_interval(0, 0, 0, 0, 0, 0, Node.heartbeat_lag_s)
    recent_lag = session.scalar(select(func.max(Node.heartbeat_lag_s)).where(
        Node.state != "removed", Node.heartbeat_lag_s > 0, recorded_at >= t - timedelta(seconds=timeout_s)))
    grace = lost_grace_s(local_oldest_s=local_oldest_s, recent_lag_s=recent_lag, cap_s=timeout_s)
    cutoff = t - timedelta(seconds=timeout_s + grace)
    stmt = select(Node).where(Node.state == "ready", Node.last_heartbeat_at < cutoff)
    if interval_s is not None:
        extra = func.greatest(0.0, func.coalesce(Node.heartbeat_interval_s, interval_s) - interval_s)
        stmt = stmt.where(Node.last_heartbeat_at < literal(t) - func.make_interval(
            0, 0, 0, 0, 0, 0, literal(timeout_s + grace) + extra))
    lost = session.scalars(
        stmt.order_by(Node.id)
        .with_for_update(key_share=True, skip_locked=True)
        .execution_options(populate_existing=True)
    ).all()
    work: list[tuple[uuid.UUID, uuid.UUID, Node]] = []  # (job, attempt, node): locked in that order
    for node in lost:
        told = node.heartbeat_interval_s if interval_s is not None else None
        waited = grace + (timeout_s + max(0.0, (told or 0.0) - (interval_s or 0.0)) if told else timeout_s)
        set_node_state(session, node, "lost", f"node {node.name} missed heartbeats for {waited:g}s",
                       kind="node.lost")
        work += [(job_id, attempt_id, node) for attempt_id, job_id in session.execute(
            select(Attempt.id, Attempt.job_id)
            .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
            .where(AttemptPart.node_id == node.id, AttemptPart.released_at.is_(None),
                   Attempt.state.in_(ATTEMPT_HOLDING))
        ).all()]
    # Jobs, then attempts, in id order across every lost node (services/locks.py).
    for _, attempt_id, node in sorted(work, key=lambda w: (w[0], w[1], w[2].id)):
        locked = lock_attempt(session, attempt_id)
        assert locked is not None
        job, attempt = locked
        if attempt.outcome is None:
            attempts.fail_attempt(session, job, attempt, f"node {node.name} lost", node_id=node.id, kind="node_lost")
        elif attempt.outcome == "failed" and attempt.failed_node_id != node.id:
            # The workers of the other nodes saw their peer vanish and exited first, so the
            # attempt failed before this node was declared lost: the lost node is the cause.
            attempt.failed_node_id = node.id
            attempt.end_reason = f"node {node.name} lost ({attempt.end_reason})"
            events.record(session, "attempt.blame", f"attempt {attempt.number}: node {node.name} was lost",
                          job_id=job.id, attempt_id=attempt.id, node_id=node.id)
        # A cancel does not wait for a lost node (its leases stay held, visibly, on it). A release
        # of this attempt waits for its lock, sees the outcome and ends it (release_parts).
        attempts.finish_if_released(session, job, attempt)
    return list(lost)


def remove_node(session: Session, node_id: uuid.UUID) -> Node:
    """An operator removes a node: its credential stops working and, if it was lost, its leases are
    released (the operator vouches that its processes are gone). A node that is not lost and still
    runs or stops an attempt is refused: its processes exist, and its GPUs must not be given away."""
    node = lock_node(session, node_id)
    if node is None or node.state == "removed":
        raise NotFound(f"node {node_id} does not exist")
    parts = session.execute(
        select(AttemptPart, Attempt, Job)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .join(Job, Job.id == Attempt.job_id)
        .where(AttemptPart.node_id == node.id, AttemptPart.released_at.is_(None))
        .order_by(Job.id, Attempt.id)  # the lock order: jobs, then attempts, by id
    ).all()
    if node.state != "lost":
        # A live node's agent would register it again within a heartbeat, under the same id and
        # without its cordon: only a node whose agent stopped (lost) can be removed.
        if parts:
            running = ", ".join(sorted({f"attempt {a.number} of job {j.name} ({j.id})" for _, a, j in parts}))
            raise InvalidState(
                f"node {node.name} is {node.state} and still holds {running}; cancel those jobs or wait until "
                "they end, then stop its agent (a lost node can be removed at any time)"
            )
        raise InvalidState(
            f"node {node.name} is {node.state}: its agent still heartbeats and would register it again; "
            "drain it, stop its agent, and remove it once it shows as lost"
        )
    node.token_hash = hash_token(secrets.token_urlsafe(32))  # its credential stops working
    set_node_state(session, node, "removed", f"node {node.name} removed by an operator", kind="node.removed",
                   released_parts=len(parts))
    for _, attempt, _ in parts:
        locked = lock_attempt(session, attempt.id)
        assert locked is not None
        job, attempt = locked
        if attempt.outcome is None:
            attempts.fail_attempt(session, job, attempt, f"node {node.name} removed", node_id=node.id,
                                  kind="node_lost")
    released = attempts.release_parts(session, [part.id for part, _, _ in parts])
    session.commit()
    forget_registered_count()
    attempts.finish_released(session, released)  # after the commit: see finish_released
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
    node = lock_node(session, node_id)
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
