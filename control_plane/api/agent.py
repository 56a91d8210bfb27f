"""/v1/agent: the node agents' side of the wire contract (control_plane/schemas/agent.py)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from sqlalchemy import text

from control_plane import failpoints
from control_plane.api.deps import Credentials, JoinDep, NodeIdentity, SessionDep, SettingsDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.errors import Unauthorized
from control_plane.schemas.agent import (
    AGENT_API_PREFIX,
    AttemptStatusAck,
    AttemptStatusReport,
    HeartbeatRequest,
    HeartbeatResponse,
    LogAck,
    LogBatch,
    NodeAttemptState,
    RegisterRequest,
    RegisterResponse,
    ShardAck,
    ShardReport,
    WaitRequest,
    WaitResponse,
    WorkerEventAck,
    WorkerEventBatch,
)
from control_plane.services import attempts, checkpoints, logs, nodes

router = APIRouter(prefix=AGENT_API_PREFIX, tags=["agent"], route_class=TransactionRoute)


@router.post("/register", response_model=RegisterResponse, responses=ERRORS)
def register(body: RegisterRequest, session: SessionDep, settings: SettingsDep, _: JoinDep,
             request: Request) -> RegisterResponse:
    node, token = nodes.register(session, body)
    interval = nodes.tell_interval(session, node, settings)
    session.commit()
    request.app.state.wake_scheduler()
    return RegisterResponse(node_id=str(node.id), node_token=token,
                            heartbeat_interval_s=interval,
                            node_lost_timeout_s=settings.lost_timeout_for(interval),
                            agent_instance=node.agent_instance, agent_epoch=node.agent_epoch,
                            storage=dict(request.app.state.worker_storage or {}))


@router.post("/heartbeat", response_model=HeartbeatResponse, responses=ERRORS)
def heartbeat(body: HeartbeatRequest, node: NodeIdentity, session: SessionDep, settings: SettingsDep,
              request: Request) -> HeartbeatResponse:
    released_before = session.info.get("released", 0)
    storage = request.app.state.worker_storage
    specs = nodes.heartbeat(session, node, body, storage)
    interval = nodes.tell_interval(session, node, settings)
    state = node.state
    if session.info.get("released", 0) == released_before:
        # Liveness only (no lease released, no attempt failed): losing this commit in a database
        # crash loses nothing the next heartbeat does not say again, so don't wait for the WAL flush.
        # At 1 heartbeat/s per node that flush was half of a heartbeat's cost (bench/scale.py).
        session.execute(text("SET LOCAL synchronous_commit = off"))
    session.commit()
    if session.info.get("released", 0) != released_before:
        # GPUs were just freed, perhaps the last ones a recovering job waits for: schedule now
        # (its own transaction) and answer with the result, rather than a heartbeat later.
        if settings.run_loops and request.app.state.loops.schedule_once():
            specs = nodes.assignments(session, node, storage)
            session.commit()
        else:
            request.app.state.wake_scheduler()
    full, unchanged = nodes.for_agent(specs, body.known)
    return HeartbeatResponse(node_id=str(node.id), node_state=state, assignments=full, unchanged=unchanged,
                             heartbeat_interval_s=interval)


@router.post("/wait", response_model=WaitResponse, responses=ERRORS)
async def wait(body: WaitRequest, creds: Credentials, request: Request) -> WaitResponse:
    """Long poll (schemas/agent.py): holds no thread and no database connection while it waits."""
    token = creds.credentials if creds is not None else ""
    node_id = nodes.node_id_of(token)
    if node_id is None:
        raise Unauthorized("missing or malformed node credential: send 'Authorization: Bearer <node token>'")
    settings = request.app.state.settings
    timeout = min(body.timeout_s or settings.agent_wait_timeout_s, settings.agent_wait_timeout_s)
    factory = request.app.state.session_factory
    changed = await request.app.state.wakeups.wait(
        node_id, lambda: nodes.desired_changed(factory, token, node_id, body.known), timeout)
    return WaitResponse(changed=changed)


@router.post("/attempts/{attempt_id}/status", response_model=AttemptStatusAck, responses=ERRORS)
def attempt_status(attempt_id: uuid.UUID, body: AttemptStatusReport, node: NodeIdentity,
                   session: SessionDep) -> AttemptStatusAck:
    if body.state in (NodeAttemptState.exited, NodeAttemptState.stopped):
        failpoints.hit("agent.final_status")  # a slow final status (fault tests)
    attempt, part = attempts.apply_status(session, node, attempt_id, body)
    ack = AttemptStatusAck(attempt_state=attempt.state, stop=part.desired == "stop")
    session.commit()
    return ack


@router.post("/attempts/{attempt_id}/logs", response_model=LogAck, responses=ERRORS)
def attempt_logs(attempt_id: uuid.UUID, body: LogBatch, node: NodeIdentity, session: SessionDep) -> LogAck:
    return LogAck(accepted=logs.append(session, node, attempt_id, body))


@router.post("/attempts/{attempt_id}/shards", response_model=ShardAck, responses=ERRORS)
def attempt_shards(attempt_id: uuid.UUID, body: ShardReport, node: NodeIdentity, session: SessionDep,
                   request: Request) -> ShardAck:
    """Phase 1 of a checkpoint; when the last shard of a step arrives, phase 2 commits it."""
    ready = checkpoints.record_shards(session, node, attempt_id, body)
    session.commit()
    store = request.app.state.object_store
    for checkpoint_id in ready:
        if store is not None:
            checkpoints.commit_ready(request.app.state.session_factory, store, checkpoint_id)
    # Only the steps whose own checkpoint is committed (by this request or another replica).
    steps = checkpoints.committed_steps(session, attempt_id, {s.step for s in body.shards})
    session.commit()
    return ShardAck(accepted=len(body.shards), committed_steps=steps)


@router.post("/attempts/{attempt_id}/events", response_model=WorkerEventAck, responses=ERRORS)
def attempt_events(attempt_id: uuid.UUID, body: WorkerEventBatch, node: NodeIdentity,
                   session: SessionDep) -> WorkerEventAck:
    accepted = checkpoints.record_worker_events(session, node, attempt_id, body)
    session.commit()
    return WorkerEventAck(accepted=accepted)
