"""The environment a node agent gives every worker process, one name each (standard library only).

The agent sets these (node_agent/part/commands.py, ``worker_env``) besides torchrun's own RANK,
WORLD_SIZE, ...; the worker runtime reads them (worker_runtime/context.py, ``WorkerContext``); the
rank shim and the agent's process table read some back (node_agent/ranks/shim.py, confinement/processes.py).
This module imports nothing beyond the standard library, so the rank shim can import it cheaply.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

PREFIX: Final = "TRAINYARD_"
"""Every Trainyard variable starts with it; the agent strips its own from what workers inherit,
and jobs may not set any (control_plane/schemas/jobs.py)."""

ENV_JOB_ID: Final = "TRAINYARD_JOB_ID"
ENV_JOB_NAME: Final = "TRAINYARD_JOB_NAME"
ENV_ATTEMPT_ID: Final = "TRAINYARD_ATTEMPT_ID"
"""Also the marker by which the agent finds every process of an attempt (node_agent/confinement/processes.py)."""
ENV_ATTEMPT_NUMBER: Final = "TRAINYARD_ATTEMPT_NUMBER"
ENV_FENCING_TOKEN: Final = "TRAINYARD_FENCING_TOKEN"
"""Authenticates a worker's reports to the agent's local API (a stale attempt gets 409)."""
ENV_AGENT_URL: Final = "TRAINYARD_AGENT_URL"
"""Base URL of the agent's local API (trainyard.protocol.agent, LocalProgress and the rest). With
ENV_AGENT_SOCKET set (the agent's case) it only names the host of the requests; the connection goes
to that socket."""
ENV_AGENT_SOCKET: Final = "TRAINYARD_AGENT_SOCKET"
"""Path of the unix socket the agent serves this attempt's local API on: one per attempt, which
only the attempt's own uid may connect to (node_agent/local/api.py)."""
LOCAL_API_PREFIX: Final = "/v1/local"
"""The local API's paths under ENV_AGENT_URL: ``<url>/v1/local/attempts/<attempt id>/<kind>``."""
ENV_NODE_RANK: Final = "TRAINYARD_NODE_RANK"
ENV_NODE_NAME: Final = "TRAINYARD_NODE_NAME"
"""The name of the node whose agent started the process (for people reading a process list)."""
ENV_NODE_ID: Final = "TRAINYARD_NODE_ID"
"""The control plane's id of the node whose agent started the process: a new agent instance of
that node finds its orphans by it. An id, not the name: names repeat across clusters (every dev
cluster has a node-1), and an agent must never take another cluster's workers for its own."""
ENV_DEVICE: Final = "TRAINYARD_DEVICE"
"""``cpu`` (virtual slots, gloo) or ``cuda`` (NCCL)."""
ENV_CHECKPOINT: Final = "TRAINYARD_CHECKPOINT"
"""JSON of the job's checkpoint settings."""
ENV_RESTORE_FROM: Final = "TRAINYARD_RESTORE_FROM"
"""JSON RestorePlan (references to checkpoints, not their manifests), or ``null``."""
ENV_LAYOUT: Final = "TRAINYARD_LAYOUT"
"""JSON of the job's parallel layout (trainyard.protocol.layout.Layout); absent: plain DDP."""
ENV_STATUS_DIR: Final = "TRAINYARD_STATUS_DIR"
"""Where the rank shim writes ``rank-<r>.json`` (node_agent/ranks/shim.py)."""
ENV_JOB_ENV: Final = "TRAINYARD_JOB_ENV"
"""JSON object of the job's own ``env``: the rank shim applies it to the training process only, so
none of it reaches torchrun or the shim (a job's PET_*, LD_PRELOAD or PATH cannot change them)."""
ENV_STANDBY_DIR: Final = "TRAINYARD_STANDBY_DIR"
"""Where the agent's warm standby processes listen (node_agent/ranks/standby.py), when it keeps any: the
rank shim hands its rank to one of them instead of a cold start. Never seen by the training process."""

ENV_RENDEZVOUS: Final = "TRAINYARD_RENDEZVOUS"
"""JSON ``{"host", "port"}``: a fenced rendezvous (trainyard/protocol/restart.py) the worker joins with
explicit rank and world size instead of torchrun's env://; set only for restartable attempts."""
ENV_NNODES: Final = "TRAINYARD_NNODES"
"""The attempt's node count, set with ENV_RENDEZVOUS: torchrun then runs per node as a local supervisor
only (``--standalone``), and the rank shim sets the global RANK (node rank x local world size + local
rank) and WORLD_SIZE (``global_rank``). Also set for a ``command`` job (no ENV_RENDEZVOUS there)."""

# --- A `command` job's contract (LaunchSpec.command; docs/writing-jobs.md, "Jobs that bring their
# own launcher"): what the job's own launcher needs to start the node's processes itself. ---
ENV_NPROC_PER_NODE: Final = "TRAINYARD_NPROC_PER_NODE"
"""Processes (GPUs) per node of a ``command`` job: its launcher's ``--nproc-per-node``."""
ENV_WORLD_SIZE: Final = "TRAINYARD_WORLD_SIZE"
"""nnodes x nproc-per-node of a ``command`` job."""
ENV_MASTER_ADDR: Final = "TRAINYARD_MASTER_ADDR"
"""Node rank 0's address: where a ``command`` job's rendezvous (torchrun's static store) listens."""
ENV_MASTER_PORT: Final = "TRAINYARD_MASTER_PORT"
"""The attempt's own port on node rank 0, for the rendezvous of a ``command`` job's launcher."""
ENV_LOCAL_ADDR: Final = "TRAINYARD_LOCAL_ADDR"
"""This node's address (torchrun's ``--local-addr``), given to a ``command`` job."""


def global_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(RANK, WORLD_SIZE) of a restartable attempt's worker, from its node rank, node count and
    torchrun's local rank and local world size; None for any other worker (torchrun's are global)."""
    if not environ.get(ENV_RENDEZVOUS) or not environ.get(ENV_NNODES):
        return None
    local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    node_rank = int(environ.get(ENV_NODE_RANK, "0"))
    return node_rank * local_world + int(environ.get("LOCAL_RANK", "0")), int(environ[ENV_NNODES]) * local_world

# Checkpoint storage. Under an agent a worker gets only ENV_STORAGE_ACCESS and the prefix: it reads
# and writes through presigned URLs (trainyard/protocol/grants.py) and holds no credential. The
# TRAINYARD_S3_* variables are for a script run outside Trainyard with storage of its own; an agent
# never sets them (node_agent/part/commands.py).
ENV_STORAGE_ACCESS: Final = "TRAINYARD_STORAGE_ACCESS"
"""``presigned``: checkpoint storage exists, reached through URLs the agent obtains per object."""
ENV_S3_ENDPOINT: Final = "TRAINYARD_S3_ENDPOINT"
ENV_S3_ACCESS_KEY: Final = "TRAINYARD_S3_ACCESS_KEY"
ENV_S3_SECRET_KEY: Final = "TRAINYARD_S3_SECRET_KEY"
ENV_S3_BUCKET: Final = "TRAINYARD_S3_BUCKET"
ENV_S3_SECURE: Final = "TRAINYARD_S3_SECURE"
"""``1`` or ``0``."""
ENV_S3_REGION: Final = "TRAINYARD_S3_REGION"
ENV_S3_CA_FILE: Final = "TRAINYARD_S3_CA_FILE"
"""PEM file of the CA(s) that sign S3's certificate (a script with storage of its own)."""
ENV_S3_CA_PEM: Final = "TRAINYARD_S3_CA_PEM"
"""The same CA(s) as PEM text: what an agent gives its workers when the control plane has
TRAINYARD_S3_CA_FILE (trainyard/protocol/s3tls.py). A CA certificate, never a credential."""
ENV_CHECKPOINT_PREFIX: Final = "TRAINYARD_CHECKPOINT_PREFIX"
"""The job's checkpoint prefix in the bucket, ``LaunchSpec.storage["prefix"]``
(trainyard.protocol.keys, ``job_checkpoint_prefix``)."""

STORAGE_ENV: Final[dict[str, str]] = {
    "endpoint": ENV_S3_ENDPOINT,
    "access_key": ENV_S3_ACCESS_KEY,
    "secret_key": ENV_S3_SECRET_KEY,
    "bucket": ENV_S3_BUCKET,
    "secure": ENV_S3_SECURE,
    "region": ENV_S3_REGION,
    "ca_file": ENV_S3_CA_FILE,
    "ca_pem": ENV_S3_CA_PEM,
    "access": ENV_STORAGE_ACCESS,
}
"""S3 access key (as in LaunchSpec.storage and S3Config.from_mapping) -> the worker's variable."""

WORKER_ENV: Final = frozenset({
    ENV_JOB_ID, ENV_JOB_NAME, ENV_ATTEMPT_ID, ENV_ATTEMPT_NUMBER, ENV_FENCING_TOKEN, ENV_AGENT_URL,
    ENV_AGENT_SOCKET, ENV_NODE_RANK, ENV_NODE_NAME, ENV_NODE_ID, ENV_DEVICE, ENV_CHECKPOINT, ENV_RESTORE_FROM,
    ENV_LAYOUT, ENV_STATUS_DIR, ENV_JOB_ENV, *STORAGE_ENV.values(), ENV_CHECKPOINT_PREFIX, ENV_RENDEZVOUS,
    ENV_NNODES, ENV_NPROC_PER_NODE, ENV_WORLD_SIZE, ENV_MASTER_ADDR, ENV_MASTER_PORT, ENV_LOCAL_ADDR,
})
"""Every variable above: what an agent may give a worker, all of it under PREFIX."""


# --- A job's own env (JobSubmit.env, LaunchSpec.env) ---

MAX_JOB_ENV_BYTES: Final = 32 * 1024
"""The most a job's env may hold (names, values, one '=' and one NUL each), the hard cap behind the
control plane's ``max_env_bytes`` setting; an agent refuses to launch a larger one."""

JOB_ENV_RESERVED: Final = frozenset({
    # torchrun's identity of each worker, and the rendezvous.
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    # The GPUs the node leased to this attempt.
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "NVIDIA_VISIBLE_DEVICES",
    # Where the agent confines the worker (its own home and temporary directory, its own user).
    "HOME", "TMPDIR", "USER", "LOGNAME", "PATH",
    # Loader and interpreter hijacks: they run code before anything the job could check.
    "LD_PRELOAD", "LD_AUDIT", "PYTHONHOME",
})
"""Names a job may not set: the platform sets them, or they would run code ahead of the job's."""

JOB_ENV_RESERVED_PREFIXES: Final = (PREFIX, "PET_", "TORCHELASTIC_")
"""Trainyard's own variables and torchrun's configuration (PET_* are torchrun's options)."""


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def job_env_problem(name: str, value: str) -> str | None:
    """Why a job may not set ``name`` to ``value``, or None when it may. PYTHONPATH is allowed: it
    is appended to the platform's, never put in front of it."""
    if not _ENV_NAME.fullmatch(name):
        return f"env name {name!r} is not a valid variable name"
    if name in JOB_ENV_RESERVED or name.startswith(JOB_ENV_RESERVED_PREFIXES):
        return f"env name {name!r} is set by Trainyard or torchrun and cannot be set by a job"
    if "\0" in value:
        return f"env value of {name!r} contains a NUL byte"
    return None


def job_env_bytes(env: dict[str, str]) -> int:
    """The size of ``env`` as an environment block: each ``NAME=value`` and its NUL."""
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())
