"""Who this worker process is: its attempt, its ranks, and where its agent listens.

torchrun gives the ranks (RANK, LOCAL_RANK, ...); the node agent adds the TRAINYARD_* variables,
named and defined by the wire contract, ``trainyard/protocol/env.py`` (standard library only: a
training image installs ``trainyard[worker]`` and never the control plane).

Run outside Trainyard (plain ``python train.py``) every variable is missing and the context
describes a single standalone process: rank 0 of 1, no agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

# Set by the node agent for every worker process (node_agent/part/commands.py, worker_env).
from trainyard.protocol.env import (
    ENV_AGENT_SOCKET,
    ENV_AGENT_URL,
    ENV_ATTEMPT_ID,
    ENV_ATTEMPT_NUMBER,
    ENV_CHECKPOINT,
    ENV_CHECKPOINT_PREFIX,
    ENV_DEVICE,
    ENV_FENCING_TOKEN,
    ENV_JOB_ID,
    ENV_JOB_NAME,
    ENV_LAYOUT,
    ENV_NODE_RANK,
    ENV_RENDEZVOUS,
    ENV_RESTORE_FROM,
    STORAGE_ENV,
)
from trainyard.protocol.layout import Layout
from trainyard.protocol.restart import Rendezvous, rendezvous_from_env

# Set by torchrun (torch.distributed.run) for every worker it starts.
ENV_RANK = "RANK"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"

Device = Literal["cpu", "cuda"]
_DEVICES: tuple[str, ...] = ("cpu", "cuda")

# Identity used when the script runs outside Trainyard.
STANDALONE_ID = "standalone"


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """The identity and environment of one worker process; build it with :meth:`from_env`."""

    job_id: str = STANDALONE_ID
    """Control-plane id of the job (``standalone`` outside Trainyard)."""
    job_name: str = STANDALONE_ID
    attempt_id: str = STANDALONE_ID
    """The attempt this process belongs to; every report names it."""
    attempt_number: int = 0
    """0 for the first attempt of the job, then 1, 2, ... after each recovery."""
    fencing_token: str = field(default="", repr=False)
    """Proves to the agent that reports come from the current attempt (stale ones get 409). A secret:
    left out of the repr, so that it is in no log line or traceback."""
    rank: int = 0
    """Global rank across all nodes of the attempt."""
    local_rank: int = 0
    """Rank on this node; also the CUDA ordinal of this process's GPU."""
    world_size: int = 1
    node_rank: int = 0
    """The control plane's rank of this node in the attempt (what the agent reports under)."""
    group_rank: int = 0
    """torchrun's rank of this node. The agent pins it to node_rank (static rendezvous,
    node_agent/part/commands.py); under another launcher (a c10d rendezvous sorts nodes by address)
    it may differ. Global ranks derive from it, never from node_rank."""
    local_world_size: int = 1
    device: Device = "cpu"
    """``cuda`` (NCCL) on GPU nodes, ``cpu`` (gloo) on nodes with virtual slots."""
    agent_url: str | None = None
    """Base URL of the node agent's local API; None when run outside Trainyard."""
    agent_socket: str | None = None
    """The unix socket the agent serves this attempt's local API on (requests go there, whatever
    host agent_url names); None: connect to agent_url itself."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """The job's checkpoint settings, as the control plane sent them (opaque here)."""
    restore_from: dict[str, Any] | None = None
    """The restore plan, ``{"candidates": [reference, ...]}`` most recent first (each reference names a
    checkpoint and its manifest in storage; see checkpoint.restore.resolve), or None."""
    storage: dict[str, str] = field(default_factory=dict, repr=False)
    """Checkpoint storage. Under an agent only ``access`` (``presigned``: URLs per object, obtained
    through the agent); a script run outside Trainyard may give its own endpoint, bucket,
    access_key, secret_key, secure, region. May hold a secret, so it stays out of repr."""
    checkpoint_prefix: str | None = None
    """Where this job's checkpoints live in the bucket (``jobs/<job_id>/checkpoints``)."""
    layout: Layout = field(default_factory=Layout)
    """The parallel layout the job asks for (TRAINYARD_LAYOUT; plain DDP when absent), applied by
    ``worker_runtime.layouts.apply_layout``."""
    rendezvous: Rendezvous | None = None
    """A fenced rendezvous (TRAINYARD_RENDEZVOUS, trainyard/protocol/restart.py) joined with explicit
    rank and world size; None: torchrun's env:// (the default)."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.local_world_size < 1 or self.local_world_size > self.world_size:
            raise ValueError(f"local_world_size {self.local_world_size} must be in 1..world_size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank {self.local_rank} is outside local_world_size {self.local_world_size}")
        if min(self.node_rank, self.group_rank, self.attempt_number) < 0:
            raise ValueError("node_rank, group_rank and attempt_number must be >= 0")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.agent_url is not None and not (self.attempt_id and self.fencing_token):
            # Without both the agent would answer every report with 409; fail at startup instead.
            raise ValueError("an agent_url requires an attempt_id and a fencing_token")

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that reports the result."""
        return self.rank == 0

    @property
    def managed(self) -> bool:
        """True when a Trainyard node agent started this process."""
        return self.agent_url is not None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        """Read torchrun's and Trainyard's variables (``os.environ`` unless ``environ`` is given)."""
        env = os.environ if environ is None else environ
        agent_url = env.get(ENV_AGENT_URL) or None
        group_rank = _int(env, ENV_GROUP_RANK, _int(env, ENV_NODE_RANK, 0))
        if agent_url and not env.get(ENV_ATTEMPT_ID):
            raise ValueError(f"{ENV_AGENT_URL} is set but {ENV_ATTEMPT_ID} is not")
        return cls(
            job_id=env.get(ENV_JOB_ID) or STANDALONE_ID,
            job_name=env.get(ENV_JOB_NAME) or STANDALONE_ID,
            attempt_id=env.get(ENV_ATTEMPT_ID) or STANDALONE_ID,
            attempt_number=_int(env, ENV_ATTEMPT_NUMBER, 0),
            fencing_token=env.get(ENV_FENCING_TOKEN, ""),
            rank=_int(env, ENV_RANK, 0),
            local_rank=_int(env, ENV_LOCAL_RANK, 0),
            world_size=_int(env, ENV_WORLD_SIZE, 1),
            # Each falls back on the other: outside Trainyard, or under a launcher that sets only
            # one of them, there is a single notion of node rank.
            node_rank=_int(env, ENV_NODE_RANK, group_rank),
            group_rank=group_rank,
            local_world_size=_int(env, ENV_LOCAL_WORLD_SIZE, 1),
            device=_device(env.get(ENV_DEVICE)),
            agent_url=agent_url.rstrip("/") if agent_url else None,
            agent_socket=env.get(ENV_AGENT_SOCKET) or None,
            checkpoint=_json_object(env, ENV_CHECKPOINT) or {},
            restore_from=_json_object(env, ENV_RESTORE_FROM),
            storage={key: env[name] for key, name in STORAGE_ENV.items() if env.get(name)},
            checkpoint_prefix=(env.get(ENV_CHECKPOINT_PREFIX) or "").strip("/") or None,
            layout=_layout(env),
            rendezvous=rendezvous_from_env(env.get(ENV_RENDEZVOUS)),
        )


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def _json_object(env: Mapping[str, str], name: str) -> dict[str, Any] | None:
    raw = env.get(name)
    if raw is None or raw.strip() in ("", "null"):
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


def _layout(env: Mapping[str, str]) -> Layout:
    raw = _json_object(env, ENV_LAYOUT)
    if raw is None:
        return Layout()
    try:
        return Layout.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'layout'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{ENV_LAYOUT} is not a valid layout: {problems}") from None


def _device(raw: str | None) -> Device:
    if raw:
        value = raw.strip().lower()
        if value not in _DEVICES:
            raise ValueError(f"{ENV_DEVICE}={raw!r}: expected one of {_DEVICES}")
        return "cuda" if value == "cuda" else "cpu"
    # Standalone: use a GPU if there is one. Imported here so that reading the context stays cheap
    # for callers that never touch torch.
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
