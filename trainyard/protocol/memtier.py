"""The in-memory checkpoint tier's wire contract (docs/architecture.md, "In-memory checkpoint tier").

A rank hands the shard it just uploaded to its node agent over the attempt's local API; the agent
keeps the latest two shards per job and rank in a bounded store and pushes a copy to one peer agent on
another failure domain. A restore asks the agent for the shard by its sha256: from the agent's own
memory (``local``) or through the agent from the peer (``peer``); the worker verifies the bytes
against the committed manifest, and falls back to S3 otherwise. Entries are content-addressed by job,
rank and sha256: no commit tracking, any bytes that match the manifest are the right bytes.

Agents talk to each other over HTTPS (plain HTTP only where an operator opted out) on the agent's
memory port with a **memory grant** as the bearer credential: ``memory_grant(node key, job id)``, an
HMAC that only the control plane and the node holding the port can compute (the node key is the digest of the
node's own credential, ``memory_grant_key``). The control plane puts in a part's spec the grants of
the job for the agents it names (its peer, the sources); it gives them to agents running that job's
parts only, never to workers. The port checks a request's grant against the job id in its path, so
a bearer serves one job on one node: a forged or another job's grant stores, reads and evicts
nothing. Standard library and pydantic only.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

LOCAL_MEMORY_KIND: Final = "memory"
"""The local API's route kind: ``/v1/local/attempts/<id>/memory[/<rank>/<sha256>]``."""
PEER_PREFIX: Final = "/v1/peer/jobs"
"""Agent-to-agent: ``PUT|GET <prefix>/<job id>/shards/<rank>/<sha256>``."""
TOKEN_HEADER: Final = "X-Trainyard-Fencing-Token"
"""The attempt's fencing token on the local API's binary (non-JSON) memory requests."""
TIER_HEADER: Final = "X-Trainyard-Tier"
"""Which tier served a GET: ``local`` or ``peer``."""
TIERS: Final = ("local", "peer")
"""What a worker may ask its agent for, in the order it asks."""
DEFAULT_BUDGET_MB: Final = 4096
"""The agent's default memory budget for shards (its own ranks' and its peers' together)."""
SHA256_RE: Final = re.compile(r"^[0-9a-f]{64}$")
JOB_ID_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
MAX_RANK: Final = 1 << 20


class MemoryTierSpec(BaseModel):
    """LaunchSpec.memory: where this part's agent keeps a second copy of its ranks' shards, and where
    a restore may find them. None in the spec: the tier is off for the part."""

    model_config = ConfigDict(extra="forbid")

    secret: str = Field(min_length=32, max_length=128, description="The job's memory secret (agents only; "
                        "never passed to workers). Authenticates nothing on the wire: the memory grants do.")
    peer_url: str | None = Field(default=None, max_length=300, pattern=r"^https?://[A-Za-z0-9._:\[\]%-]+$",
                                 description="The peer agent that keeps a copy of this node's shards "
                                 "(another failure domain when one exists); None: no peer.")
    sources: list[str] = Field(default_factory=list, max_length=4, description="Other agents that may hold "
                               "this node rank's shards from the previous attempt (its node, its peer), asked "
                               "after the local store and peer_url.")
    grants: dict[str, str] = Field(default_factory=dict, max_length=6, description="The job's grant for each "
                                   "agent named here (its memory URL -> memory_grant of that node's key): the "
                                   "bearer that agent's memory port accepts for this job. An agent without a "
                                   "grant is not asked.")


class MemoryStatus(BaseModel):
    """``GET /v1/local/attempts/<id>/memory``: whether the worker should hand shards over."""

    enabled: bool
    budget_bytes: int = 0
    peer: bool = False


GRANT_CONTEXT: Final = b"trainyard memory-tier grant/1:"


def memory_grant_key(node_credential: str) -> str:
    """A node's grant key: the sha256 of its current credential (what the control plane stores of it,
    so both sides have it and nothing new is kept); a new registration is a new key."""
    return hashlib.sha256(node_credential.encode("utf-8", "surrogatepass")).hexdigest()


def memory_grant(node_key: str, job_id: str) -> str:
    """The bearer the node with ``node_key`` accepts for ``job_id`` on its memory port."""
    return hmac.new(node_key.encode(), GRANT_CONTEXT + job_id.encode(), hashlib.sha256).hexdigest()


def valid_sha256(value: str) -> bool:
    return bool(SHA256_RE.fullmatch(value))


def parse_rank(text: str) -> int | None:
    """A rank from a path segment, or None when it is not a small non-negative integer."""
    if not text.isdigit() or len(text) > 7:
        return None
    rank = int(text)
    return rank if rank < MAX_RANK else None


def fill(chunks: Iterable[bytes], size: int) -> bytearray | None:
    """A body of exactly ``size`` bytes from its chunks, in one buffer allocated once (a shard may be
    as large as host memory allows: joining chunks would hold it twice); None when the body is
    longer or shorter."""
    buffer = bytearray(size)
    got = 0
    for chunk in chunks:
        if got + len(chunk) > size:
            return None
        buffer[got:got + len(chunk)] = chunk
        got += len(chunk)
    return buffer if got == size else None


def chunks(data: bytes | bytearray, size: int = 8 * 1024 * 1024) -> Iterator[bytes]:
    """``data`` in pieces to send (with an explicit Content-Length): never copied whole once more."""
    view = memoryview(data)
    for start in range(0, len(view), size):
        yield bytes(view[start:start + size])


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (a worker to its agent's local API)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("trainyard-agent", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def get_body(conn: http.client.HTTPConnection, path: str, headers: dict[str, str], limit: int,
             admit: Callable[[int], bool] | None = None) -> bytearray | None:
    """GET ``path`` and read a 200 answer's body straight into one buffer (``readinto``: no chunk
    copies, no joining: a shard moves at memory speed); None for any other answer, a body without a
    Content-Length or over ``limit``, one that ``admit`` (given its length, before anything is
    allocated) turns down, or one that ends early. Raises OSError/HTTPException when the connection
    fails."""
    try:
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        size = answer.getheader("Content-Length") or ""
        if answer.status != 200 or not size.isdigit() or int(size) > limit:
            answer.read(64 * 1024)  # a problem's few bytes: closing before them would break the sender's pipe
            return None
        if admit is not None and not admit(int(size)):
            return None
        buffer = bytearray(int(size))
        view = memoryview(buffer)
        got = 0
        while got < len(buffer):
            n = answer.readinto(view[got:])
            if not n:
                return None
            got += n
        return buffer
    finally:
        conn.close()
