"""Worker logs shipped by agents, stored per (attempt, node rank, rank, stream, offset)."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Iterator

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from control_plane.db import rowcount, session_scope
from control_plane.errors import Forbidden, StaleAttempt
from control_plane.models import Attempt, AttemptNode, Job, LogChunk, Node
from control_plane.services.states import JOB_TERMINAL
from trainyard.protocol.agent import LogBatch


def append(session: Session, node: Node, attempt_id: uuid.UUID, batch: LogBatch) -> int:
    """Store a batch; a resent chunk (same position) is stored once.

    Logs are data, not reports: they are accepted for any attempt whose token matches, current
    or not, so the last words of a failed attempt are kept. They never change any state.
    """
    attempt = session.get(Attempt, attempt_id)
    if attempt is None or not secrets.compare_digest(attempt.fencing_token, batch.fencing_token):
        raise StaleAttempt(f"attempt {attempt_id} is unknown or its fencing token does not match")
    part = session.scalar(
        select(AttemptNode).where(AttemptNode.attempt_id == attempt.id, AttemptNode.node_rank == batch.node_rank)
    )
    if part is None or part.node_id != node.id:
        raise Forbidden(f"node {node.name} does not hold node rank {batch.node_rank} of attempt {attempt_id}")
    if not batch.chunks:
        return 0
    rows = [
        {
            "job_id": attempt.job_id,
            "attempt_id": attempt.id,
            "node_rank": batch.node_rank,
            "rank": c.rank,
            "stream": c.stream,
            "offset": c.offset,
            "data": c.data.replace("\x00", ""),
        }
        for c in batch.chunks
    ]
    result = session.execute(insert(LogChunk).values(rows).on_conflict_do_nothing())
    session.commit()
    return rowcount(result)


def read(
    session: Session,
    job_id: uuid.UUID,
    *,
    attempt_number: int | None = None,
    node_rank: int | None = None,
    rank: int | None = None,
    stream: str | None = None,
    after: int = 0,
    limit: int = 1000,
) -> list[tuple[LogChunk, int]]:
    """Chunks in arrival order with their attempt number."""
    stmt = (
        select(LogChunk, Attempt.number)
        .join(Attempt, Attempt.id == LogChunk.attempt_id)
        .where(LogChunk.job_id == job_id, LogChunk.id > after)
        .order_by(LogChunk.id)
        .limit(limit)
    )
    if attempt_number is not None:
        stmt = stmt.where(Attempt.number == attempt_number)
    if node_rank is not None:
        stmt = stmt.where(LogChunk.node_rank == node_rank)
    if rank is not None:
        stmt = stmt.where(LogChunk.rank == rank)
    if stream is not None:
        stmt = stmt.where(LogChunk.stream == stream)
    return [(c, n) for c, n in session.execute(stmt)]


def format_chunk(chunk: LogChunk, attempt_number: int, *, prefix: bool = True) -> str:
    if not prefix:
        return chunk.data
    tag = f"[a{attempt_number} n{chunk.node_rank} r{chunk.rank}{' err' if chunk.stream == 'stderr' else ''}] "
    lines = chunk.data.splitlines(keepends=True)
    return "".join(tag + line if line.endswith("\n") else tag + line + "\n" for line in lines)


def stream_text(
    factory: sessionmaker[Session],
    job_id: uuid.UUID,
    *,
    attempt_number: int | None = None,
    node_rank: int | None = None,
    rank: int | None = None,
    stream: str | None = None,
    prefix: bool = True,
    follow: bool = False,
    poll_s: float = 1.0,
) -> Iterator[str]:
    """The job's logs as text, in arrival order; with ``follow``, until the job ends. Each read is
    its own short transaction: no connection is held while the client reads or while it waits."""
    after = 0
    while True:
        with session_scope(factory) as s:
            chunks = read(s, job_id, after=after, attempt_number=attempt_number, node_rank=node_rank,
                          rank=rank, stream=stream)
            ended = s.scalar(select(Job.state).where(Job.id == job_id)) in JOB_TERMINAL
        for chunk, number in chunks:
            after = chunk.id
            yield format_chunk(chunk, number, prefix=prefix)
        if chunks:
            continue
        if not follow or ended:
            return
        time.sleep(poll_s)
