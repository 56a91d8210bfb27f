"""Fencing: every report about an attempt must come from the job's current attempt, carry its
secret token, and come from the node that holds the claimed node rank (docs/architecture.md)."""

from __future__ import annotations

import uuid

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from control_plane.authz import same_secret
from control_plane.errors import Forbidden, StaleAttempt
from control_plane.models import Attempt, AttemptPart, Job, Node, Worker
from control_plane.services.locks import lock_job_attempt, share_job_attempt


def lock_attempt(session: Session, attempt_id: uuid.UUID) -> tuple[Job, Attempt] | None:
    """Lock an attempt's job, then the attempt (FOR NO KEY UPDATE), and load both afresh; None if
    unknown.

    Every transaction takes its locks in one order, node -> job -> attempt -> attempt parts
    (services/locks.py), so two of them never deadlock, and a decision that reads the other parts
    (is every node released?) sees what the transactions before it committed.
    """
    return lock_job_attempt(session, attempt_id)


def authorize_report(
    session: Session, node: Node, attempt_id: uuid.UUID, fencing_token: str, node_rank: int,
    *, exclusive: bool = True,
) -> tuple[Job, Attempt, AttemptPart]:
    """Fencing: refuse anything not from the job's current attempt with the right token.

    ``exclusive`` locks the job and the attempt for a change of either (lock_attempt). A report
    that changes neither row (a shard report, most worker events) passes ``exclusive=False``: the
    two rows are then locked ``FOR SHARE`` (services/locks.py share_job_attempt), which holds off
    any change of the job's current attempt until the report commits, yet lets the reports of all
    the job's nodes proceed at once. Such a transaction must not then update or lock either row
    exclusively (two sharers upgrading would deadlock)."""
    locked = lock_attempt(session, attempt_id) if exclusive else share_job_attempt(session, attempt_id)
    if locked is None or not same_secret(fencing_token, locked[1].fencing_token):
        raise StaleAttempt(f"attempt {attempt_id} is unknown or its fencing token does not match")
    job, attempt = locked
    if job.current_attempt_id != attempt.id:
        raise StaleAttempt(
            f"attempt {attempt.number} of job {job.id} is stale: the current attempt is another one",
            attempt_id=str(attempt_id),
        )
    part = session.scalar(
        select(AttemptPart).where(AttemptPart.attempt_id == attempt.id, AttemptPart.node_rank == node_rank)
    )
    if part is None or part.node_id != node.id:
        raise Forbidden(f"node {node.name} does not hold node rank {node_rank} of attempt {attempt_id}")
    return job, attempt, part


def check_own_ranks(session: Session, part: AttemptPart, ranks: set[int]) -> None:
    """A node speaks only for its own ranks: none of ``ranks`` may be a worker of another node's
    part of the attempt, and once this part has reported workers, each must be in their block (one
    torchrun runs ``per node`` consecutive global ranks). torchrun's c10d rendezvous decides which
    block a node gets, so a part's ranks are known from its first status report with workers on;
    before it, a shard report is checked against the other parts only.

    Reads O(the report's ranks + this part's workers) rows, whatever the world size: only the
    workers of ``ranks`` and this part's own (reading every worker of the attempt made each of a
    1,024-rank gang's 128 reports read 1,024 rows, the bulk of a report's cost: bench/scale.py)."""
    if not ranks:
        return
    per_node = max(1, len(part.gpu_indices))
    owners = dict(session.execute(
        select(Worker.rank, Worker.attempt_part_id).where(
            Worker.attempt_id == part.attempt_id,
            or_(Worker.rank.in_(sorted(ranks)), Worker.attempt_part_id == part.id))).all())
    theirs = sorted(r for r in ranks if r in owners and owners[r] != part.id)
    if theirs:
        raise Forbidden(f"ranks {theirs} are workers of another node of the attempt; node rank {part.node_rank} "
                        "reports only its own")
    blocks = {rank // per_node for rank, owner in owners.items() if owner == part.id}
    outside = sorted(r for r in ranks if blocks and r // per_node not in blocks)
    if outside:
        raise Forbidden(f"ranks {outside} are not in node rank {part.node_rank}'s block of {per_node} ranks")


def check_worker_block(ranks: list[tuple[int, int]], *, world: int, per_node: int) -> None:
    """The ranks one node's torchrun runs: ``per_node`` consecutive global ranks starting at a
    multiple of ``per_node`` (group rank x local world size + local rank), inside the world. Pure;
    raises Forbidden."""
    bases = set()
    for rank, local_rank in ranks:
        if not (0 <= rank < world and 0 <= local_rank < per_node):
            raise Forbidden(f"rank {rank} (local rank {local_rank}) is outside the attempt's {world} ranks of "
                            f"{per_node} per node")
        bases.add(rank - local_rank)
    if len(bases) > 1 or any(b % per_node for b in bases):
        raise Forbidden(f"ranks {sorted(r for r, _ in ranks)} are not one node's block of {per_node} ranks")
