"""Worker logs shipped by agents, stored per (attempt, node rank, rank, stream, offset)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio.to_thread
from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session, sessionmaker

from control_plane.authz import same_secret
from control_plane.db import rowcount, session_scope
from control_plane.errors import Forbidden, StaleAttempt
from control_plane.models import Attempt, AttemptPart, Job, LogChunk, Node
from control_plane.services.access.gates import PrincipalGate
from control_plane.services.states import JOB_TERMINAL
from trainyard.protocol.agent import LogBatch


def append(session: Session, node: Node, attempt_id: uuid.UUID, batch: LogBatch) -> int:
    """Store a batch; a resent chunk (same position) is stored once.

    Logs are data, not reports: they are accepted for any attempt whose token matches, current
    or not, so the last words of a failed attempt are kept. They never change any state.
    """
    attempt = session.get(Attempt, attempt_id)
    if attempt is None or not same_secret(batch.fencing_token, attempt.fencing_token):
        raise StaleAttempt(f"attempt {attempt_id} is unknown or its fencing token does not match")
    part = session.scalar(
        select(AttemptPart).where(AttemptPart.attempt_id == attempt.id, AttemptPart.node_rank == batch.node_rank)
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


@dataclass(frozen=True)
class LogQuery:
    """Which lines of a job's logs: all, or those of one attempt, node rank, rank or stream."""

    job_id: uuid.UUID
    attempt_number: int | None = None
    node_rank: int | None = None
    rank: int | None = None
    stream: str | None = None
    prefix: bool = True


class Followers(PrincipalGate):
    """Logs followed at once, per principal, on this replica (settings.log_followers_per_principal).
    A follower holds no thread and no connection while it waits, but it does hold a socket and a
    poll: the cap keeps one principal from taking a replica's polls."""

    def __init__(self, per_principal: int) -> None:
        super().__init__(per_principal, what="followed logs", setting="log_followers_per_principal",
                         advice="stop one or retry later")


def _read_once(factory: sessionmaker[Session], query: LogQuery, after: int) -> tuple[list[tuple[LogChunk, int]], bool]:
    """One short transaction: the next chunks after ``after``, and whether the job has ended."""
    with session_scope(factory) as s:
        chunks = read(s, query.job_id, after=after, attempt_number=query.attempt_number, node_rank=query.node_rank,
                      rank=query.rank, stream=query.stream)
        ended = s.scalar(select(Job.state).where(Job.id == query.job_id)) in JOB_TERMINAL
    return chunks, ended


def open_stream(
    factory: sessionmaker[Session],
    query: LogQuery,
    *,
    follow: bool,
    poll_s: float,
    disconnected: Callable[[], Awaitable[bool]],
    followers: Followers | None = None,
    principal: str = "",
) -> AsyncIterator[str]:
    """The job's logs as text, in arrival order; with ``follow``, until the job ends or the client
    goes away. The first read happens here, in the caller's thread, so that a failure is an error
    status rather than a broken body. After that each read is its own short transaction in a worker
    thread; between reads nothing is held (an asyncio sleep, no thread, no connection), so followers
    cannot starve the requests (heartbeats) that need the threads and the pool."""
    if follow and followers is not None:
        followers.acquire(principal)
    try:
        first, ended = _read_once(factory, query, 0)
    except BaseException:
        if follow and followers is not None:
            followers.release(principal)
        raise

    async def body() -> AsyncIterator[str]:
        chunks, done = first, ended
        after = 0
        try:
            while True:
                for chunk, number in chunks:
                    after = chunk.id
                    yield format_chunk(chunk, number, prefix=query.prefix)
                if not chunks:
                    if not follow or done:
                        return
                    await anyio.sleep(poll_s)
                    if await disconnected():
                        return
                chunks, done = await anyio.to_thread.run_sync(_read_once, factory, query, after)
        finally:
            if follow and followers is not None:
                followers.release(principal)

    return body()
