"""/v1/nodes and /v1/cluster."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from control_plane.api.deps import PrincipalDep, SessionDep
from control_plane.api.jobs import ERRORS
from control_plane.schemas.nodes import ClusterOut, NodeOut
from control_plane.services import cluster, nodes, views

router = APIRouter(prefix="/v1", tags=["cluster"])


@router.get("/nodes", response_model=list[NodeOut], responses=ERRORS)
def list_nodes(session: SessionDep, _: PrincipalDep) -> list[NodeOut]:
    return views.node_out(session, nodes.list_nodes(session))


@router.get("/nodes/{node_id}", response_model=NodeOut, responses=ERRORS)
def get_node(node_id: uuid.UUID, session: SessionDep, _: PrincipalDep) -> NodeOut:
    return views.node_out(session, [nodes.get_node(session, node_id)])[0]


@router.delete("/nodes/{node_id}", response_model=NodeOut, responses=ERRORS, summary="Remove a node")
def remove_node(node_id: uuid.UUID, session: SessionDep, _: PrincipalDep, request: Request) -> NodeOut:
    """Forget a node. A **lost** node's GPU leases are released: you vouch that its workers are gone
    (powered off, reinstalled). A node that is not lost and still holds an attempt is refused (409).
    If its agent comes back later, it registers again as a new, empty node."""
    node = nodes.remove_node(session, node_id)
    request.app.state.wake_scheduler()
    return views.node_out(session, [node])[0]


@router.get("/cluster", response_model=ClusterOut, responses=ERRORS)
def get_cluster(session: SessionDep, _: PrincipalDep) -> ClusterOut:
    """Capacity, utilization and the queue in service order."""
    return cluster.summary(session)
