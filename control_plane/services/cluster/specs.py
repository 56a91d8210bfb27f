"""Launch specs: what a node's agent runs, and what a heartbeat or a long poll answers about them
(docs/architecture.md, "Heartbeat payloads: specs once, then references").

A part's spec never changes once its attempt is allocated (the job, the attempt and the part it
is built from are fixed by then; ``launched`` is not part of its version), so its version is
computed once, at allocation, and stored with the part (``attempt_parts.spec_version``). A
heartbeat or a wait whose agent holds every spec at its version then reads one narrow row per
assigned attempt and builds no spec at all: at 1,000 nodes that was most of an idle heartbeat's
work, and the comparison that starts every long poll.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptPart, Job
from control_plane.services.runs import parking
from control_plane.services.states import ATTEMPT_LIVE
from trainyard.protocol.agent import AssignmentRef, CodeRef, KnownAssignment, LaunchSpec
from trainyard.protocol.keys import job_checkpoint_prefix
from trainyard.protocol.layout import Layout
from trainyard.protocol.memtier import MemoryTierSpec

SPEC_STORAGE_KEYS = ("prefix",)
"""The part of LaunchSpec.storage that is per attempt; the rest (credentials) goes to an agent once,
in the RegisterResponse."""


def launch_spec(job: Job, attempt: Any, part: Any, storage: dict[str, object] | None) -> LaunchSpec:
    """The spec of ``part`` (an AttemptPart, or a row about to be inserted with the same fields) of
    ``attempt`` (likewise), versioned."""
    spec = LaunchSpec(
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
        command=list(job.command) if job.command else None,
        env=dict(job.env),
        checkpoint=_checkpoint(job, attempt),
        layout=Layout.model_validate(job.layout) if job.layout else None,
        code=CodeRef.model_validate(job.code) if job.code else None,
        python=job.python,
        requirements=job.requirements,
        restore_from=attempt.restore_manifest,
        restartable=bool(job.restartable),
        adopts=str(part.adopts_attempt_id) if getattr(part, "adopts_attempt_id", None) else None,
        memory=_memory(job, part),
        launched=part.state != "assigned",
        storage={**(storage or {}), "prefix": job_checkpoint_prefix(job.id)},
    )
    spec.version = spec_version(spec)
    return spec


def _memory(job: Job, part: Any) -> MemoryTierSpec | None:
    """The part's in-memory checkpoint tier (services/checkpoints/memtier.py), or None where it is off."""
    block = getattr(part, "memory", None)
    if not block or not job.memory_secret:
        return None
    return MemoryTierSpec(secret=job.memory_secret, peer_url=block.get("peer_url"), sources=block.get("sources") or [],
                          grants=block.get("grants") or {})


def _checkpoint(job: Job, attempt: Any) -> dict[str, object]:
    """The job's checkpoint block; an 'auto' job's with the interval its attempt starts with (fixed per
    attempt, so the spec's version does not change with each new choice: those come in status answers)."""
    block = dict(job.checkpoint)
    if attempt.checkpoint_interval_steps is not None:
        block["auto_interval_steps"] = attempt.checkpoint_interval_steps
    return block


def spec_version(spec: LaunchSpec) -> str:
    """The etag of a launch spec: a digest of its content, credentials excluded, so it changes when
    and only when what the agent would launch changes. ``launched`` is left out too: it flips when
    the part is first reported started, and it only tells an agent that does not hold the spec
    (its work dir was lost) not to start it; resending every node's spec then was a full spec per
    node in the steady state (tests/e2e/test_scale.py). Keys are sorted: the same spec reads back
    from JSONB columns with its keys in another order."""
    body = spec.model_copy(update={"storage": _spec_storage(spec), "version": "", "launched": False})
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _spec_storage(spec: LaunchSpec) -> dict[str, object]:
    return {k: v for k, v in spec.storage.items() if k in SPEC_STORAGE_KEYS}


def desired_versions(session: Session, node_id: uuid.UUID) -> dict[str, str | None]:
    """The attempts this node must run now (its desired state), each with its stored spec version
    (None for a part allocated before versions were stored). One narrow query."""
    rows = session.execute(
        select(AttemptPart.attempt_id, AttemptPart.spec_version)
        .join(Attempt, Attempt.id == AttemptPart.attempt_id)
        .where(AttemptPart.node_id == node_id, AttemptPart.desired == "run", Attempt.state.in_(ATTEMPT_LIVE))
    ).all()
    return {str(r.attempt_id): r.spec_version for r in rows}


def specs(session: Session, node_id: uuid.UUID, storage: dict[str, object] | None,
          attempt_ids: Iterable[str] | None = None) -> list[LaunchSpec]:
    """The node's desired specs in full (only those of ``attempt_ids``, when given)."""
    stmt = (
        select(Attempt, AttemptPart, Job)
        .join(AttemptPart, AttemptPart.attempt_id == Attempt.id)
        .join(Job, Job.id == Attempt.job_id)
        .where(AttemptPart.node_id == node_id, AttemptPart.desired == "run", Attempt.state.in_(ATTEMPT_LIVE))
    )
    if attempt_ids is not None:
        ids = [uuid.UUID(a) for a in attempt_ids]
        if not ids:
            return []
        stmt = stmt.where(Attempt.id.in_(ids))
    return [launch_spec(job, attempt, part, storage) for attempt, part, job in session.execute(stmt).all()]


def answer(session: Session, node_id: uuid.UUID, known: list[KnownAssignment] | None,
           storage: dict[str, object] | None) -> tuple[list[LaunchSpec], list[AssignmentRef]]:
    """What a heartbeat answers, given the specs the node's agent holds (``known``).

    An old agent (``known`` is None) gets every spec in full, credentials included. Otherwise only
    new or changed specs go in full, without credentials; every known one comes as a reference:
    'run' when it is still assigned at that version, 'stop' when it is no longer assigned. So the
    steady-state answer grows with the node's own attempts, not with the job's size or arguments,
    and costs one narrow read (``desired_versions``) when nothing is new."""
    if known is None:
        return specs(session, node_id, storage), []
    held = {k.attempt_id: k.version for k in known}
    desired = desired_versions(session, node_id)
    stale = [a for a, version in desired.items() if version is None or held.get(a) != version]
    built = {s.attempt_id: s for s in specs(session, node_id, storage, stale)} if stale else {}
    full: list[LaunchSpec] = []
    refs: list[AssignmentRef] = []
    for attempt_id, version in desired.items():
        spec = built.get(attempt_id)
        if spec is not None:
            version = spec.version
        mine = held.pop(attempt_id, None)
        if mine is not None and mine == version:
            refs.append(AssignmentRef(attempt_id=attempt_id, desired="run", version=mine))
        elif spec is not None:
            full.append(spec.model_copy(update={"storage": _spec_storage(spec)}))
    # A stop says whether the part may be parked for a handover (services/runs/parking.py): the agent
    # parks only then, and stops anything else at once.
    ok = parking.handover_ok(session, node_id, held) if held else set()
    refs.extend(AssignmentRef(attempt_id=a, desired="stop", version=v, handover_ok=a in ok)
                for a, v in sorted(held.items()))
    return full, refs

