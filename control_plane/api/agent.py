"""/v1/agent: the node agents' side of the wire contract (trainyard/protocol/agent.py).

Thin routes over services/cluster/agent_protocol.py, which owns each message's transaction.

A route authenticates the node's credential (``NodeToken``: no database) in its own transaction, as
its first statement: a dependency doing it (``NodeIdentity``) ran in a thread of its own and had to end
its transaction before the endpoint's thread began, which cost every agent request a second
transaction, a connection checkout and a thread hand-off (bench/request_cost.py)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse

from control_plane.api.deps import (
    ArrivedAt,
    NodeToken,
    RegisterCredential,
    RuntimeDep,
    SessionDep,
    SettingsDep,
    TransactionRoute,
)
from control_plane.api.jobs import ERRORS
from control_plane.errors import Unauthorized
from control_plane.services.checkpoints import storage_grants, upload_slots
from control_plane.services.cluster import agent_protocol, nodes
from control_plane.services.runs import code, logs
from trainyard.protocol.agent import (
    AGENT_API_PREFIX,
    AttemptStatusAck,
    AttemptStatusReport,
    HeartbeatRequest,
    HeartbeatResponse,
    LogAck,
    LogBatch,
    RegisterRequest,
    RegisterResponse,
    ShardAck,
    ShardReport,
    WaitRequest,
    WaitResponse,
    WorkerEventAck,
    WorkerEventBatch,
)
from trainyard.protocol.grants import StorageBatchAnswer, StorageBatchRequest, StorageGrants, StorageRequest
from trainyard.protocol.uploads import (
    SlotAnswer,
    SlotBatchAnswer,
    SlotBatchRequest,
    SlotRelease,
    SlotReleased,
    SlotRequest,
)

router = APIRouter(prefix=AGENT_API_PREFIX, tags=["agent"], route_class=TransactionRoute)


@router.post("/register", response_model=RegisterResponse, responses=ERRORS)
def register(body: RegisterRequest, session: SessionDep, settings: SettingsDep, credential: RegisterCredential,
             runtime: RuntimeDep) -> RegisterResponse:
    """With a join token (a new node, or the node a join token is bound to), or with the node's own
    current credential (an agent registering again). A registered node's name is never taken
    with an unbound join token (409 node-name-taken)."""
    node, token, interval = agent_protocol.register(session, body, credential, runtime, settings)
    return RegisterResponse(node_id=str(node.id), node_token=token,
                            heartbeat_interval_s=interval,
                            node_lost_timeout_s=settings.lost_timeout_for(interval),
                            agent_instance=node.agent_instance, agent_epoch=node.agent_epoch,
                            storage=runtime.worker_storage)


@router.post("/heartbeat", response_model=HeartbeatResponse, responses=ERRORS)
def heartbeat(body: HeartbeatRequest, token: NodeToken, session: SessionDep, settings: SettingsDep,
              runtime: RuntimeDep, arrived_at: ArrivedAt) -> HeartbeatResponse:
    node = nodes.authenticate(session, token, lock=True)  # first in the lock order, as nodes.heartbeat wants it
    answer = agent_protocol.heartbeat_and_schedule(session, node, body, runtime.worker_storage, runtime, settings,
                                                   arrived_at, locked=True)
    return HeartbeatResponse(node_id=str(node.id), node_state=answer.node_state, assignments=answer.assignments,
                             unchanged=answer.unchanged, heartbeat_interval_s=answer.heartbeat_interval_s)


@router.post("/wait", response_model=WaitResponse, response_model_exclude_none=True, responses=ERRORS)
async def wait(body: WaitRequest, token: NodeToken, settings: SettingsDep, runtime: RuntimeDep) -> WaitResponse:
    """Long poll (trainyard/protocol/agent.py): holds no thread and no database connection while it
    waits."""
    node_id = nodes.node_id_of(token)
    if node_id is None:
        raise Unauthorized("missing or malformed node credential: send 'Authorization: Bearer <node token>'")
    timeout = min(body.timeout_s or settings.agent_wait_timeout_s, settings.agent_wait_timeout_s)
    factory = runtime.session_factory
    change = await runtime.wakeups.wait(
        node_id, lambda: nodes.desired_change(factory, token, node_id, body.known), timeout)
    if change is None:
        return WaitResponse(changed=False)
    if not body.answer:
        return WaitResponse(changed=True)
    full, unchanged = change
    return WaitResponse(changed=True, assignments=full, unchanged=unchanged)


@router.post("/attempts/{attempt_id}/status", response_model=AttemptStatusAck, responses=ERRORS)
def attempt_status(attempt_id: uuid.UUID, body: AttemptStatusReport, token: NodeToken,
                   session: SessionDep, runtime: RuntimeDep, settings: SettingsDep) -> AttemptStatusAck:
    node = nodes.authenticate(session, token)
    answer = agent_protocol.report_status(session, node, attempt_id, body, runtime,
                                          budgets=settings.recovery_budgets)
    return AttemptStatusAck(attempt_state=answer.attempt_state, stop=answer.stop, released=answer.released,
                            checkpoint_interval_steps=answer.checkpoint_interval_steps,
                            handover_ok=answer.handover_ok)


@router.post("/attempts/{attempt_id}/logs", response_model=LogAck, responses=ERRORS)
def attempt_logs(attempt_id: uuid.UUID, body: LogBatch, token: NodeToken, session: SessionDep) -> LogAck:
    node = nodes.authenticate(session, token)
    return LogAck(accepted=logs.append(session, node, attempt_id, body))


@router.post("/attempts/{attempt_id}/shards", response_model=ShardAck, responses=ERRORS)
def attempt_shards(attempt_id: uuid.UUID, body: ShardReport, token: NodeToken, session: SessionDep,
                   runtime: RuntimeDep) -> ShardAck:
    """Phase 1 of a checkpoint; when the last shard of a step arrives, phase 2 commits it."""
    node = nodes.authenticate(session, token)
    steps = agent_protocol.report_shards(session, node, attempt_id, body, runtime.object_store,
                                         runtime.session_factory)
    return ShardAck(accepted=len(body.shards), committed_steps=steps)


@router.get("/attempts/{attempt_id}/code", response_class=Response, summary="The job's shipped code",
            responses={200: {"content": {"application/gzip": {}}}, **ERRORS})
def attempt_code(attempt_id: uuid.UUID, token: NodeToken, session: SessionDep, runtime: RuntimeDep) -> Response:
    """The tar.gz of a live attempt's job's code (CodeRef in its LaunchSpec), for a node of that attempt;
    409 for an attempt that is not live or not the node's."""
    node = nodes.authenticate(session, token)
    chunks, sha256 = code.fetch_for_node(session, node, attempt_id, runtime.object_store)
    return StreamingResponse(chunks, media_type="application/gzip", headers={"X-Content-SHA256": sha256})


@router.post("/attempts/{attempt_id}/events", response_model=WorkerEventAck, responses=ERRORS)
def attempt_events(attempt_id: uuid.UUID, body: WorkerEventBatch, token: NodeToken,
                   session: SessionDep) -> WorkerEventAck:
    node = nodes.authenticate(session, token)
    return WorkerEventAck(accepted=agent_protocol.report_events(session, node, attempt_id, body))


@router.post("/attempts/{attempt_id}/storage", response_model=StorageGrants, responses=ERRORS)
def attempt_storage(attempt_id: uuid.UUID, body: StorageRequest, token: NodeToken, session: SessionDep,
                    settings: SettingsDep, runtime: RuntimeDep) -> StorageGrants:
    """Presigned URLs for the checkpoint objects a worker of the attempt may read or write
    (trainyard/protocol/grants.py); workers hold no storage credential."""
    node = nodes.authenticate(session, token)
    return storage_grants.grant(session, node, attempt_id, body, runtime.object_store, settings)


@router.post("/attempts/{attempt_id}/storage/batch", response_model=StorageBatchAnswer, responses=ERRORS)
def attempt_storage_batch(attempt_id: uuid.UUID, body: StorageBatchRequest, token: NodeToken, session: SessionDep,
                          settings: SettingsDep, runtime: RuntimeDep) -> StorageBatchAnswer:
    """Several workers' storage requests in one: each answered as `/storage` would (its grants, or
    its refusal's status and detail), in order; a stale attempt refuses the whole batch (409)."""
    node = nodes.authenticate(session, token)
    return storage_grants.grant_batch(session, node, attempt_id, body, runtime.object_store, settings)


@router.post("/attempts/{attempt_id}/upload-slots", response_model=SlotAnswer, responses=ERRORS)
async def upload_slot(attempt_id: uuid.UUID, body: SlotRequest, token: NodeToken, settings: SettingsDep,
                      runtime: RuntimeDep) -> SlotAnswer:
    """A checkpoint upload slot, as a long poll (trainyard/protocol/uploads.py): granted, or waiting with
    the queue position after `wait_s`. Asking again for the same (rank, step) polls or renews it. Holds no
    thread and no database connection while it waits."""
    gated = runtime.lanes.run_gated if runtime.lanes is not None else None  # its transactions are bookkeeping
    return await upload_slots.ask_and_wait(runtime.session_factory, runtime.slot_wakeups, runtime.slot_passes, token,
                                           attempt_id, body, settings, gated)


@router.post("/attempts/{attempt_id}/upload-slots/release", response_model=SlotReleased, responses=ERRORS)
def release_upload_slot(attempt_id: uuid.UUID, body: SlotRelease, token: NodeToken, session: SessionDep,
                        settings: SettingsDep, runtime: RuntimeDep) -> SlotReleased:
    """The upload ended (or failed, or its worker stopped waiting): the slot goes to the next waiter."""
    node = nodes.authenticate(session, token)
    released = upload_slots.release_and_grant(session, node, attempt_id, body, runtime.session_factory, settings,
                                              runtime.slot_passes)
    return SlotReleased(released=released)


@router.post("/attempts/{attempt_id}/upload-slots/batch", response_model=SlotBatchAnswer, responses=ERRORS)
async def upload_slot_batch(attempt_id: uuid.UUID, body: SlotBatchRequest, token: NodeToken, settings: SettingsDep,
                            runtime: RuntimeDep) -> SlotBatchAnswer:
    """The upload-slot asks and releases of several of the node's ranks in one long poll
    (trainyard/protocol/uploads.py): releases first, then the asks, answered in order once any is
    granted or after `wait_s`. Fenced once for the whole batch. Holds no thread and no database
    connection while it waits."""
    gated = runtime.lanes.run_gated if runtime.lanes is not None else None  # its transactions are bookkeeping
    return await upload_slots.batch_and_wait(runtime.session_factory, runtime.slot_wakeups, runtime.slot_passes,
                                             token, attempt_id, body, settings, gated)
