"""The in-memory checkpoint tier's part in allocation (docs/architecture.md, "In-memory checkpoint
tier"): which peer agent keeps a copy of each part's shards, and where a new attempt's part may
find the previous attempt's copies.

Decided once, at allocation, and stored with the part (``attempt_parts.memory``): a part's spec
never changes afterwards (services/cluster/specs.py). The peer is another node whose agent serves the tier,
on another failure domain (the scheduler's topology label) when one exists, else any other such
node: a copy on the same rack dies with the rack. Among the candidates the choice is spread by a
hash of the job and node rank, so one node is not every node's peer. The job's memory secret is
made at its first allocation; it reaches agents only, in their launch specs. So does each
**memory grant** (trainyard/protocol/memtier.py ``memory_grant``): the bearer that one node's memory port
accepts for this job, derived from that node's key (the hash of its credential, which only the
node and this table have). A block carries the grants of exactly the agents it names (the peer and
the sources), so an agent can push a job's shards only where the control plane sent them, and a
port refuses any bearer that is not a grant of the job in the request's path. A job with
``checkpoint.memory_tier: false`` gets no block at all: its parts' specs carry no memory tier, so
their agents keep none of its shards and push none to a peer.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.models import Attempt, AttemptPart, Job, Node
from trainyard.protocol.memtier import memory_grant

MAX_SOURCES = 4


@dataclass(frozen=True)
class PeerNode:
    node_id: uuid.UUID
    domain: str
    url: str
    key: str = ""
    """The node's grant key (Node.token_hash: the agent computes the same from its credential)."""


def peer_url(address: str, port: int, tls: bool = False) -> str:
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address
    return f"{'https' if tls else 'http'}://{host}:{port}"


def choose_peer(node_id: uuid.UUID, domain: str, candidates: Sequence[PeerNode], seed: str) -> PeerNode | None:
    """The peer of ``node_id``: a candidate on another domain if any, else any other; None alone.
    Pure: the same inputs give the same peer."""
    others = [c for c in candidates if c.node_id != node_id]
    away = [c for c in others if c.domain != domain] or others
    if not away:
        return None
    away.sort(key=lambda c: str(c.node_id))
    pick = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") % len(away)
    return away[pick]


def memory_tier_on(job: Job) -> bool:
    """The job's ``checkpoint.memory_tier`` (on unless the job turned it off)."""
    return (job.checkpoint or {}).get("memory_tier", True) is not False


class Peers:
    """The nodes that may serve as peers now (ready, with a memory port), loaded once per pass."""

    def __init__(self, session: Session, topology_label: str) -> None:
        self.session = session
        self.topology_label = topology_label
        rows = session.scalars(select(Node).where(Node.state == "ready", Node.memory_port.is_not(None))).all()
        self.nodes = {n.id: PeerNode(n.id, n.domain(topology_label),
                                     peer_url(n.address, n.memory_port or 0, bool(n.memory_tls)), n.token_hash)
                      for n in rows}
        self._keys = {node.url: node.key for node in self.nodes.values()}

    def blocks(self, job: Job, node_ids: Sequence[uuid.UUID], previous: int | None) -> list[dict[str, Any] | None]:
        """Each node rank's memory block (None where its node's agent serves no tier); gives the
        job its memory secret when it has none (the caller holds the job's lock)."""
        if not memory_tier_on(job) or not any(n in self.nodes for n in node_ids):
            return [None] * len(node_ids)
        if job.memory_secret is None:
            job.memory_secret = secrets.token_hex(32)
        earlier = self._previous_sources(job.id, previous) if previous else {}
        candidates = list(self.nodes.values())
        out: list[dict[str, Any] | None] = []
        for rank, node_id in enumerate(node_ids):
            me = self.nodes.get(node_id)
            if me is None:
                out.append(None)
                continue
            peer = choose_peer(node_id, me.domain, candidates, f"{job.id}:{rank}")
            url = None if peer is None else peer.url
            sources = [s for s in earlier.get(rank, []) if s not in (url, me.url) and s in self._keys][:MAX_SOURCES]
            named = [u for u in (url, *sources) if u]
            grants = {u: memory_grant(self._keys[u], str(job.id)) for u in named}
            out.append({"peer_url": url, "sources": sources, "grants": grants})
        return out

    def _previous_sources(self, job_id: uuid.UUID, number: int) -> dict[int, list[str]]:
        """Node rank -> where the attempt ``number`` kept that rank's shards (its node, its peer)."""
        rows = self.session.execute(
            select(AttemptPart.node_rank, AttemptPart.node_id, AttemptPart.memory)
            .join(Attempt, Attempt.id == AttemptPart.attempt_id)
            .where(Attempt.job_id == job_id, Attempt.number == number)
        ).all()
        out: dict[int, list[str]] = {}
        for rank, node_id, memory in rows:
            urls: list[str] = []
            node = self.nodes.get(node_id)
            if node is not None:  # still ready: its agent may hold the shards (its workers died, not it)
                urls.append(node.url)
            if memory and isinstance(memory.get("peer_url"), str):
                urls.append(memory["peer_url"])
            out[rank] = urls
        return out
