"""In-process restart of healthy ranks: the fenced rendezvous and the next-assignment message.

When a peer fails, a worker that opted in (``worker_runtime.restart.run_restartable``) does not
exit: it aborts its process group and asks its own agent, with the fencing token of the attempt it
belonged to, for its part of the next attempt
(``POST /v1/local/attempts/<old attempt id>/next-assignment``: LocalNextAssignment ->
NextAssignmentAnswer). It then joins the new attempt's rendezvous with the new token only.

The rendezvous store (a TCPStore at the attempt's own host and port, hosted by global rank 0) is
fenced twice, from the token alone (docs/architecture.md, "In-process restart"):

- before joining, a rank compares ``rendezvous_verifier`` (attempt id + token) with the one the
  store's host wrote; a mismatch refuses the join at once (StaleRendezvous in the runtime);
- every key of the process group lives under ``rendezvous_keyspace``, derived separately from the
  token, so a process that does not hold the new token cannot even name the keys the gang uses.

The verifier is a digest of a different message than the keyspace, so reading it from the store
reveals nothing about the keyspace. Standard library and pydantic only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainyard.protocol.env import ENV_RENDEZVOUS

VERIFIER_KEY: Final = "trainyard/rendezvous/verifier"
"""The one key outside the keyspace: the host's verifier, read by every joining rank."""

NEXT_ASSIGNMENT: Final = "next-assignment"
"""The local API's kind (path suffix) a parked worker polls."""

_VERIFIER_TAG = b"trainyard-rendezvous-verifier\0"
_KEYSPACE_TAG = b"trainyard-rendezvous-keyspace\0"

Port = Annotated[int, Field(ge=1, le=65535)]


def _digest(tag: bytes, attempt_id: str, fencing_token: str) -> str:
    return hashlib.sha256(tag + attempt_id.encode() + b"\0" + fencing_token.encode()).hexdigest()


def rendezvous_verifier(attempt_id: str, fencing_token: str) -> str:
    """What the store's host publishes and every joining rank must match."""
    return _digest(_VERIFIER_TAG, attempt_id, fencing_token)


def rendezvous_keyspace(attempt_id: str, fencing_token: str) -> str:
    """The prefix of every key of the attempt's process group in the store."""
    return "trainyard/pg/" + _digest(_KEYSPACE_TAG, attempt_id, fencing_token)[:32]  # PrefixStore adds "/"


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Rendezvous(_Wire):
    host: str = Field(min_length=1, max_length=255)
    port: Port

    def to_env(self) -> str:
        return json.dumps({"host": self.host, "port": self.port})


def rendezvous_from_env(raw: str | None) -> Rendezvous | None:
    """The fenced rendezvous ENV_RENDEZVOUS names, None when unset; ValueError when malformed."""
    if raw is None or not raw.strip():
        return None
    try:
        return Rendezvous.model_validate_json(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_RENDEZVOUS} is not a valid rendezvous: {exc}") from None


class Assignment(_Wire):
    """One worker's part of the next attempt, as its agent hands it to a parked worker."""

    attempt_id: str = Field(min_length=1, max_length=128)
    attempt_number: int = Field(ge=0)
    fencing_token: str = Field(min_length=1, max_length=128, repr=False)
    rank: int = Field(ge=0)
    world_size: int = Field(ge=1)
    node_rank: int = Field(ge=0)
    rendezvous: Rendezvous
    restore_from: dict[str, Any] | None = None
    """The new attempt's restore plan (candidates most recent first), as in TRAINYARD_RESTORE_FROM."""
    agent_socket: str | None = Field(default=None, max_length=4096)
    """Where the agent serves the new attempt's local API to this worker (None: the same place)."""

    @model_validator(mode="after")
    def _rank_in_world(self) -> Assignment:
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        return self


class LocalNextAssignment(_Wire):
    """A parked worker's request: the token of the attempt it belonged to, and how long it waits."""

    fencing_token: str = Field(min_length=1, max_length=128)
    rank: int = Field(ge=0)
    wait_s: float = Field(default=20.0, ge=0, le=60)


class NextAssignmentAnswer(_Wire):
    """``assigned``: join ``assignment``; ``waiting``: ask again; ``stop``: no handover (exit, the
    agent cold-starts the next attempt's part)."""

    state: Literal["assigned", "waiting", "stop"]
    assignment: Assignment | None = None
    reason: str = Field(default="", max_length=1024)

    @model_validator(mode="after")
    def _assignment_iff_assigned(self) -> NextAssignmentAnswer:
        if (self.state == "assigned") != (self.assignment is not None):
            raise ValueError("an assignment comes with state 'assigned', and only then")
        return self
