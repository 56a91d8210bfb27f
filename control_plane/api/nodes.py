"""/v1/nodes and /v1/cluster."""

from __future__ import annotations

import uuid

from fastapi import APIRouter

from control_plane.api.deps import ClusterRead, NodesManage, NodesRead, RuntimeDep, SessionDep, TransactionRoute
from control_plane.api.jobs import ERRORS
from control_plane.schemas.nodes import ClusterOut, NodeLabelsIn, NodeOut
from control_plane.services.cluster import nodes
from control_plane.services.read import cluster, views

router = APIRouter(prefix="/v1", tags=["cluster"], route_class=TransactionRoute)


@router.get("/nodes", response_model=list[NodeOut], responses=ERRORS)
def list_nodes(session: SessionDep, _: NodesRead) -> list[NodeOut]:
    return views.node_out(session, nodes.list_nodes(session))


@router.get("/nodes/{node_id}", response_model=NodeOut, responses=ERRORS)
def get_node(node_id: uuid.UUID, session: SessionDep, _: NodesRead) -> NodeOut:
    return views.node_out(session, [nodes.get_node(session, node_id)])[0]


@router.delete("/nodes/{node_id}", response_model=NodeOut, responses=ERRORS, summary="Remove a node")
def remove_node(node_id: uuid.UUID, session: SessionDep, _: NodesManage, runtime: RuntimeDep) -> NodeOut:
    """Forget a node. A **lost** node's GPU leases are released: you vouch that its workers are gone
    (powered off, reinstalled). Only a **lost** node can be removed: a node whose agent still
    heartbeats is refused (409; drain it, stop its agent, remove it once it shows as lost). If its
    agent comes back later, it registers again as an empty, schedulable node (same id, no cordon)."""
    node = nodes.remove_node(session, node_id)
    runtime.wake_scheduler()
    return views.node_out(session, [node])[0]


@router.post("/nodes/{node_id}/cordon", response_model=NodeOut, responses=ERRORS, summary="Cordon a node")
def cordon_node(node_id: uuid.UUID, session: SessionDep, _: NodesManage) -> NodeOut:
    """No new work on the node; its running jobs keep running."""
    return views.node_out(session, [nodes.cordon(session, node_id)])[0]


@router.post("/nodes/{node_id}/drain", response_model=NodeOut, responses=ERRORS, summary="Drain a node")
def drain_node(node_id: uuid.UUID, session: SessionDep, _: NodesManage) -> NodeOut:
    """No new work; running jobs finish (none is stopped). `scheduling` is `drained` once nothing runs."""
    return views.node_out(session, [nodes.drain(session, node_id)])[0]


@router.post("/nodes/{node_id}/uncordon", response_model=NodeOut, responses=ERRORS, summary="Uncordon a node")
def uncordon_node(node_id: uuid.UUID, session: SessionDep, _: NodesManage, runtime: RuntimeDep) -> NodeOut:
    """The node takes new work again (after cordon or drain)."""
    node = nodes.uncordon(session, node_id)
    runtime.wake_scheduler()
    return views.node_out(session, [node])[0]


@router.put("/nodes/{node_id}/labels", response_model=NodeOut, responses=ERRORS, summary="Set a node's labels")
def set_node_labels(node_id: uuid.UUID, body: NodeLabelsIn, session: SessionDep, _: NodesManage) -> NodeOut:
    """The operator's labels (e.g. `rack`, used for topology-aware placement) replace earlier ones and
    win over the labels the agent reports."""
    return views.node_out(session, [nodes.set_labels(session, node_id, body.labels)])[0]


@router.get("/cluster", response_model=ClusterOut, responses=ERRORS)
def get_cluster(session: SessionDep, principal: ClusterRead) -> ClusterOut:
    """Capacity, utilization and the queue in service order. Members and viewers see their own
    tenant's jobs in it only."""
    return cluster.summary(session, tenant=principal.tenant_filter)
