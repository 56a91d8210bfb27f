"""Allocating an attempt: its row, one part per node and one lease per GPU, in the scheduling pass's
transaction (scheduler/allocate.py decides; this writes).

An attempt is one run of a job on a gang of GPUs, owned by a fencing token. At allocation its
restore plan is fixed (services/checkpoints/checkpoints.py), its in-memory tier's peers are chosen
(services/checkpoints/memtier.py) and each part's launch spec is versioned, once
(services/cluster/specs.py). Its nodes' status reports are merged and decided in status_reports.py;
it ends in attempts.py.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Protocol

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from control_plane import wakeups
from control_plane.clock import now
from control_plane.models import Attempt, AttemptPart, Gpu, GpuLease, Job
from control_plane.services import events
from control_plane.services.checkpoints import memtier
from control_plane.services.checkpoints.checkpoints import restore_plan
from control_plane.services.cluster import specs
from control_plane.services.runs import intervals
from control_plane.services.states import set_job_state


class NodeLike(Protocol):
    """What placing an attempt needs of a node (a ``Node`` row, or the scheduler's light copy)."""

    @property
    def id(self) -> uuid.UUID: ...
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...


NodePlacement = Sequence[tuple[NodeLike, Sequence[int]]]
"""Node rank i is ``placement[i]``: the node and its GPU indices."""


def create_attempt(session: Session, job: Job, placement: NodePlacement, *, rdzv_port: int,
                   topology_label: str = "rack") -> Attempt:
    """Create the attempt, its per-node parts and every GPU lease, in the caller's transaction.

    The database refuses a lease on a GPU that is already leased, and refuses at commit an
    attempt whose leases do not cover its whole gang.
    """
    (attempt_id,) = create_attempts(session, [(job, placement, rdzv_port)], topology_label=topology_label)
    attempt = session.get(Attempt, attempt_id)
    assert attempt is not None
    return attempt


def create_attempts(session: Session, allocations: Sequence[tuple[Job, NodePlacement, int]], *,
                    adopts: Mapping[uuid.UUID, Mapping[uuid.UUID, uuid.UUID]] | None = None,
                    follows: Mapping[uuid.UUID, Mapping[uuid.UUID, uuid.UUID]] | None = None,
                    topology_label: str = "rack") -> list[uuid.UUID]:
    """``create_attempt`` for many (job, placement, rendezvous port) at once: a scheduling pass may
    admit hundreds of gangs, so attempts, parts and leases go in as three bulk INSERTs. The jobs
    must be locked by the caller and waiting; each moves to ``starting``. Returns the attempt ids.
    ``adopts``: per job, per node, the earlier attempt whose parked part there the new part takes
    over (services/runs/handover.py released its leases first, in this transaction). ``follows``:
    per job, per node, the stopping part of its previous attempt whose leases the new part there was
    passed (handover.pass_leases, in this transaction): not released before it.
    """
    adopts, follows = adopts or {}, follows or {}
    if not allocations:
        return []
    job_ids = [job.id for job, _, _ in allocations]
    last: dict[uuid.UUID, int] = {
        job_id: number
        for job_id, number in session.execute(
            select(Attempt.job_id, func.max(Attempt.number)).where(Attempt.job_id.in_(job_ids))
            .group_by(Attempt.job_id)
        )
    }
    node_ids = {node.id for _, placement, _ in allocations for node, _ in placement}
    gpus = {
        (node_id, index): (gpu_id, kind)
        for gpu_id, node_id, index, kind in session.execute(
            select(Gpu.id, Gpu.node_id, Gpu.index, Gpu.kind).where(Gpu.node_id.in_(node_ids))
        )
    }
    t = now()
    attempt_rows: list[dict[str, Any]] = []
    part_rows: list[dict[str, Any]] = []
    lease_rows: list[dict[str, Any]] = []
    peers = memtier.Peers(session, topology_label)
    for job, placement, port in allocations:
        attempt_id = uuid.uuid4()
        earlier = last.get(job.id)
        attempt_rows.append({
            "id": attempt_id, "job_id": job.id, "number": (earlier or 0) + 1,
            "fencing_token": secrets.token_hex(24), "state": "starting", "num_gpus": job.num_gpus,
            "gpu_kind": gpus[(placement[0][0].id, placement[0][1][0])][1],  # a gang is of one kind
            "rdzv_host": placement[0][0].address, "rdzv_port": port, "created_at": t,
            # Only a job that ran before can have checkpoints to restore from.
            "restore_manifest": restore_plan(session, job) if earlier else None,
            "checkpoint_interval_steps": intervals.launch_steps(job),
        })
        memory = peers.blocks(job, [node.id for node, _ in placement], earlier)
        for node_rank, (node, indices) in enumerate(placement):
            part = {"id": uuid.uuid4(), "attempt_id": attempt_id, "node_id": node.id, "node_rank": node_rank,
                    "gpu_indices": list(indices), "desired": "run", "state": "assigned", "memory": memory[node_rank],
                    "adopts_attempt_id": adopts.get(job.id, {}).get(node.id),
                    "follows_part_id": follows.get(job.id, {}).get(node.id)}
            # Its spec never changes from now on: versioned once (services/cluster/specs.py).
            part["spec_version"] = specs.launch_spec(job, SimpleNamespace(**attempt_rows[-1]),
                                                     SimpleNamespace(**part), None).version
            part_rows.append(part)
            lease_rows += [
                {"id": uuid.uuid4(), "gpu_id": gpus[(node.id, index)][0], "node_id": node.id,
                 "attempt_id": attempt_id, "job_id": job.id, "created_at": t}
                for index in indices
            ]
    session.execute(insert(Attempt), attempt_rows)
    session.execute(insert(AttemptPart), part_rows)
    wakeups.notify_nodes(session, {row["node_id"] for row in part_rows})  # wake their long polls
    session.execute(insert(GpuLease), lease_rows)
    batch = events.Batch()
    for (job, placement, port), row in zip(allocations, attempt_rows, strict=True):
        number, attempt_id = row["number"], row["id"]
        job.current_attempt_id = attempt_id
        layout = [{"node": n.name, "node_rank": r, "gpus": list(ix)} for r, (n, ix) in enumerate(placement)]
        set_job_state(
            session,
            job,
            "starting",
            f"attempt {number} allocated {job.num_gpus} GPUs on {len(placement)} nodes",
            attempt_id=str(attempt_id),
            placement=layout,
            batch=batch,
        )
        batch.add(
            "attempt.allocated",
            f"attempt {number} gang-allocated",
            job_id=job.id,
            attempt_id=attempt_id,
            placement=layout,
            rendezvous=f"{row['rdzv_host']}:{port}",
        )
    batch.write(session)
    return [row["id"] for row in attempt_rows]
