"""Pure policy of a handover: where a restartable job's next attempt goes when parts of its previous
attempt are parked (workers alive, leases held; docs/architecture.md, "In-process restart").

A parked part's GPUs are free for its own job only, and only all together: the new attempt takes
the part over when it lands on exactly those GPU indices of that node (its processes keep them),
and nothing else may be placed there. So the job is placed on the cluster as it alone sees it:
each parked node offers exactly its parked GPUs (none of its other free ones, which would let the
placement split the node and adopt nothing), every other node what is free on it. Any node of
the placement that is a parked node is adopted; a placement that adopts nothing is no handover
(the ordinary pass places the job, and the parked parts are stopped as usual).

The same policy places a job that parks nothing onto the stopping parts of its failed attempt
(lease passing, services/runs/handover.py): ``parked`` then names those parts' GPUs, which the new
attempt takes exactly, as it would parked ones, without their processes.

No database, no clock: ``allocate.py`` reads the parked (or stopping) parts and applies the lease
transfer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from control_plane.scheduler.model import JobDemand, NodeCapacity, Placement
from control_plane.scheduler.policy import place


@dataclass(frozen=True)
class Handover:
    """A placement of a job's next attempt and the parked nodes (node id -> GPU indices) it adopts."""

    placement: Placement
    adopted: Mapping[str, tuple[int, ...]]


def seen_by(capacity: Sequence[NodeCapacity], parked: Mapping[str, Sequence[int]]) -> list[NodeCapacity]:
    """The cluster as the job that owns ``parked`` (node id -> its parked GPU indices) sees it."""
    return [dataclasses.replace(n, free=tuple(sorted(parked[n.node_id]))) if n.node_id in parked else n
            for n in capacity]


def plan_handover(job: JobDemand, capacity: Sequence[NodeCapacity], parked: Mapping[str, Sequence[int]], *,
                  topology_label: str | None = "rack", held: Collection[str] = frozenset(),
                  quota_left: int | None = None) -> Handover | None:
    """Where ``job`` goes taking over its parked parts, or None (nothing to adopt, or it does not fit).

    Only nodes in ``capacity`` (ready and schedulable) can be adopted; a parked part whose GPUs are
    not ``gpus_per_node`` of them (another shape) cannot be. The GPUs it needs besides the parked
    ones are what the ordinary pass would let it have: never on a node ``held`` for another job (a
    reservation, another recovering job's healthy nodes), and at most ``quota_left`` of them (its
    tenant's quota less what the tenant holds; None: no quota). Otherwise no handover: the
    ordinary pass decides (and the parked parts stop as usual)."""
    usable = {n: tuple(sorted(ix)) for n, ix in parked.items() if len(ix) == job.gpus_per_node}
    if not usable or not any(n.node_id in usable for n in capacity):
        return None
    view = [n for n in seen_by(capacity, usable) if n.node_id in usable or n.node_id not in held]
    placement = place(job, view, topology_label=topology_label)
    if placement is None:
        return None
    adopted = {node: tuple(sorted(ix)) for node, ix in placement.nodes
               if node in usable and tuple(sorted(ix)) == usable[node]}
    if not adopted:
        return None
    extra = sum(len(ix) for node, ix in placement.nodes if node not in adopted)
    if quota_left is not None and extra > quota_left:
        return None
    return Handover(placement=placement, adopted=adopted)


def without(capacity: Sequence[NodeCapacity], placement: Placement) -> list[NodeCapacity]:
    """``capacity`` less the GPUs ``placement`` takes (a parked node's GPUs were not free anyway)."""
    taken = {node: set(ix) for node, ix in placement.nodes}
    return [dataclasses.replace(n, free=tuple(i for i in n.free if i not in taken[n.node_id]))
            if n.node_id in taken else n for n in capacity]
