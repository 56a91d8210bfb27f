"""The wire contract between the control plane and node agents.

This module imports only pydantic: the node agent imports it without pulling in the server. The
rest of the contract is beside it in trainyard/protocol/: worker env names (env.py), the S3 key
layout of checkpoints (keys.py), the storage Protocol (storage.py).
The protocol (heartbeats, level-triggered attempt status, fencing) is described in
docs/architecture.md; every message that concerns an attempt carries its id and fencing token.

Endpoints (all under /v1/agent, JSON bodies):

- ``POST /v1/agent/register``  (``Authorization: Bearer <join token>``)
    RegisterRequest -> RegisterResponse. Idempotent per node name: re-registering the same name
    returns the same node id and a fresh node credential of the next agent epoch; the credentials
    of earlier epochs are refused from then on with 409 problem+json of type .../stale-agent.
- ``POST /v1/agent/heartbeat``  (``Authorization: Bearer <node token>``)
    HeartbeatRequest -> HeartbeatResponse. The response is the node's *desired state*: the
    attempts it must run. The agent stops every attempt it runs that is not listed. An agent
    that says which specs it holds (``known``: attempt id + spec version) gets full specs only
    for new or changed assignments and a compact reference (id, desired, version) for the rest,
    so a steady-state heartbeat is small whatever the job's size. Storage credentials come once,
    in the RegisterResponse, not in every spec.
- ``POST /v1/agent/wait``  (node token)
    WaitRequest -> WaitResponse: a long poll that returns when the node's desired state changes
    (or after about 25 s); the agent then heartbeats at once. 503 with Retry-After when the replica
    holds too many waits. So the heartbeat interval, which grows with the cluster
    (HeartbeatResponse.heartbeat_interval_s), does not delay new work or stop orders.
- ``POST /v1/agent/attempts/{attempt_id}/status``  (node token)
    AttemptStatusReport -> AttemptStatusAck, or 409 problem+json when the attempt is stale
    (not the job's current attempt, or the fencing token does not match). Level-triggered: the
    agent sends the full current status of its part of the attempt, repeatedly; the control
    plane merges it monotonically, so duplicates and reordering change nothing.
- ``POST /v1/agent/attempts/{attempt_id}/logs``  (node token)
    LogBatch -> LogAck. Chunks are keyed by (attempt, node rank, rank, stream, offset), so a
    resent chunk is stored once.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from trainyard.protocol.exits import FAILURE_KINDS
from trainyard.protocol.layout import Layout
from trainyard.protocol.limits import (
    INT32_MAX,
    INT64_MAX,
    MAX_MESSAGE_CHARS,
    MAX_METRICS,
    TEXT_LINE,
    Finite,
    Int32,
    Int64,
    JsonDocument,
    Text,
)
from trainyard.protocol.memtier import MemoryTierSpec
from trainyard.protocol.requirements import MAX_REQUIREMENTS_CHARS
from trainyard.protocol.uploads import UploadStats

AGENT_API_PREFIX = "/v1/agent"
MAX_LOG_CHUNK_CHARS = 1024 * 1024
MAX_COMMAND_ITEMS = 256
"""The most items a job's ``command`` (argv) may have."""
MAX_COMMAND_ITEM_CHARS = 4096
"""The longest one item of a job's ``command`` may be."""
CommandItem = Annotated[str, Field(min_length=1, max_length=MAX_COMMAND_ITEM_CHARS, pattern=r"^[^\x00]*$")]
"""A log chunk's text (the agent reads 64 KiB at a time: node_agent/part/logs.py)."""


class _Wire(BaseModel):
    # Agents and control planes of neighbouring versions must interoperate: ignore unknown fields.
    model_config = ConfigDict(extra="ignore")


def _clip(limit: int) -> Any:
    """Text the agent itself writes (an error it saw): cut to ``limit`` and freed of NUL rather than
    refused, so that the agent never builds a message it cannot send."""
    def clip(value: Any) -> Any:
        return value.replace("\x00", "")[:limit] if isinstance(value, str) else value
    return BeforeValidator(clip)


class GpuInfo(_Wire):
    index: int = Field(ge=0, le=4096, description="Device index on the node (CUDA ordinal or virtual slot).")
    uuid: str = Field(max_length=128, pattern=TEXT_LINE,
                      description="Stable device id (NVML UUID, or 'virtual-<node>-<index>').")
    kind: str = Field(max_length=128, pattern=TEXT_LINE,
                      description="GPU model, e.g. 'NVIDIA H100 80GB HBM3', or 'virtual-cpu'.")
    memory_mb: int = Field(ge=0, le=INT32_MAX, description="Device memory in MiB (0 for virtual slots).")


class RegisterRequest(_Wire):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    address: str = Field(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9._:\[\]%-]+$",
                         description="Address other nodes reach this node at (rendezvous host).")
    gpus: list[GpuInfo] = Field(max_length=4096)
    labels: dict[Annotated[str, Field(max_length=63, pattern=TEXT_LINE)],
                 Annotated[str, Field(max_length=253, pattern=TEXT_LINE)]] = Field(
        default_factory=dict, max_length=64, description="Topology labels, e.g. rack.")
    agent_version: str = Field("0", max_length=64, pattern=TEXT_LINE)
    agent_instance: str | None = Field(
        default=None, max_length=64, pattern=TEXT_LINE,
        description="Random id of this agent process; the control plane makes one up when absent.",
    )
    memory_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="TCP port of the agent's in-memory checkpoint tier at `address` (trainyard/protocol/memtier.py); "
        "None: the tier is off on this node and it is never chosen as a peer.",
    )
    memory_tls: bool = Field(
        default=False, description="The memory port speaks TLS with a certificate signed by the cluster's CA: "
        "peers reach it at https:// and verify it.",
    )

    @field_validator("gpus")
    @classmethod
    def _unique_indices(cls, gpus: list[GpuInfo]) -> list[GpuInfo]:
        indices = [g.index for g in gpus]
        if len(set(indices)) != len(indices):
            raise ValueError("GPU indices must be unique on a node")
        return gpus


AGENT_TRIES = 3
"""Tries of one agent request, the first included (node_agent/link/client.py, RetryPolicy)."""
AGENT_BACKOFF_S = 0.6
"""The longest total wait between those tries (jittered 0.2 s, then 0.4 s)."""


def agent_request_timeout_s(heartbeat_interval_s: float, node_lost_timeout_s: float) -> float:
    """The per-try timeout of an agent's requests (docs/architecture.md, "Time and timeouts").

    A heartbeat leaves at most ``heartbeat_interval_s`` after the last one that arrived; it and its
    retries must be over before ``node_lost_timeout_s`` runs out, so an agent whose first try hangs
    still gets a heartbeat through (a fresh one, next round) before it is declared lost."""
    return (node_lost_timeout_s - heartbeat_interval_s - AGENT_BACKOFF_S) / AGENT_TRIES


class RegisterResponse(_Wire):
    node_id: str
    node_token: str = Field(description="Per-node credential for every later call.")
    heartbeat_interval_s: float
    node_lost_timeout_s: float
    agent_instance: str | None = Field(
        default=None, description="The instance this registration fenced in; heartbeats must carry it."
    )
    agent_epoch: int = Field(
        default=0,
        description="Grows by one with every registration of the node. A request with the credential "
        "of an older registration is refused with 409 problem+json of type .../stale-agent: another "
        "agent instance registered as this node, and the old one must stop.",
    )
    storage: dict[str, Any] = Field(
        default_factory=dict,
        description="How workers reach checkpoint storage, never a credential: `access` (`presigned`: URLs "
        "per object through the agent) and `ca_pem` (the CA(s) of an S3 over HTTPS with a private CA), "
        "sent once per registration: a LaunchSpec given to an agent that reports `known` carries only "
        "its `prefix`, and the agent merges the two.",
    )


class LocalAttempt(_Wire):
    """An attempt the agent still holds on this node: it has processes, or its final status is not
    acknowledged yet. A listed attempt is never declared vanished."""

    attempt_id: str = Field(max_length=128)
    processes_alive: bool = True
    final_status_pending: bool = Field(
        default=False, description="Its processes are gone and its final status is not acknowledged yet."
    )


class KnownAssignment(_Wire):
    """A launch spec the agent holds, as the version the control plane gave it."""

    attempt_id: str = Field(max_length=128)
    version: str = Field(max_length=64)


class HeartbeatRequest(_Wire):
    agent_instance: str = Field(max_length=64, pattern=TEXT_LINE,
                                description="Random id of this agent process (changes on restart).")
    seq: int = Field(ge=0, le=INT64_MAX, description="Monotonic per agent instance; older heartbeats are ignored.")
    attempts: list[LocalAttempt] = Field(
        default_factory=list, max_length=4096,
        description="Attempts with live processes on this node, and those whose final status is pending.",
    )
    known: list[KnownAssignment] | None = Field(
        default=None,
        max_length=4096,
        description="The launch specs this agent holds (attempt id + version). None (an old agent): "
        "every assignment comes as a full spec, credentials included. A list, even empty: only new or "
        "changed specs come in full, the others as AssignmentRef.",
    )


RESTORE_PLAN_FORMAT = "trainyard.restore/2"
RESTORE_CANDIDATES_MAX = 8  # a plan never names more, whatever keep_last is


class RestoreCandidate(_Wire):
    """A reference to one committed checkpoint: workers read its manifest (every shard's key,
    size and sha256, written by the commit next to the shards) from checkpoint storage, so the
    plan's size does not grow with the world size."""

    checkpoint_id: str
    step: int = Field(ge=0)
    attempt_number: int = Field(ge=0, description="The attempt that saved it.")
    world_size: int = Field(ge=1)
    manifest_key: str = Field(min_length=1, description="Object key of the checkpoint's manifest.json.")
    manifest_sha256: str | None = Field(default=None, pattern="^[0-9a-f]{64}$",
                                        description="sha256 of the manifest object (verified by workers).")
    manifest_size_bytes: int | None = Field(default=None, ge=0)


class RestorePlan(_Wire):
    """The checkpoints a new attempt may restore from, most recent of the job's lineage first."""

    format: str = RESTORE_PLAN_FORMAT
    candidates: list[RestoreCandidate] = Field(default_factory=list, max_length=RESTORE_CANDIDATES_MAX)


class CodeRef(_Wire):
    """The job's shipped code: an archive (tar.gz) the agent fetches once per content hash
    (``GET /v1/agent/attempts/{attempt_id}/code``), checks, and unpacks into the attempt's directory;
    the workers run there and the entrypoint is resolved inside it."""

    sha256: str = Field(pattern="^[0-9a-f]{64}$")
    size_bytes: Int64


class LaunchSpec(_Wire):
    """Everything an agent needs to start its part of an attempt."""

    job_id: str
    job_name: str
    attempt_id: str
    attempt_number: int
    fencing_token: str
    node_rank: int
    nnodes: int
    nproc_per_node: int
    gpu_indices: list[int]
    rdzv_host: str = Field(description="Address of the attempt's node rank 0.")
    rdzv_port: int = Field(description="Port owned by this attempt alone.")
    entrypoint: str = Field(description="A Python module (run with -m) or a path to a .py file.")
    args: list[str] = Field(default_factory=list)
    command: list[CommandItem] | None = Field(
        default=None, min_length=1, max_length=MAX_COMMAND_ITEMS,
        description="The job's own command (argv), run once per node in place of torchrun, as the part's uid in "
        "its cgroup, under node_agent.ranks.shim (its exit is the part's); argv[0] is looked up after the uid "
        "switch. None: torchrun runs `entrypoint`.")
    env: dict[str, str] = Field(default_factory=dict)
    checkpoint: dict[str, Any] = Field(default_factory=dict)
    layout: Layout | None = Field(
        default=None,
        description="The job's parallel layout, passed to workers as TRAINYARD_LAYOUT (JSON); None: plain DDP. "
        "A few fields, the same on every node: the spec does not grow with the world size.",
    )
    restore_from: RestorePlan | None = Field(
        default=None,
        description="Restore plan: references to at most RESTORE_CANDIDATES_MAX usable checkpoints "
        "(not their manifests), or None.",
    )
    code: CodeRef | None = Field(default=None, description="Shipped code to run in, or None (the node's own).")
    python: str | None = Field(default=None, description="The interpreter for torchrun and the workers (an "
                               "absolute path on the node), or None (the agent's own).")
    requirements: str | None = Field(
        default=None, max_length=MAX_REQUIREMENTS_CHARS,
        description="A pip requirements file to install (from wheels) into a virtualenv cached by content hash on "
        "the node, built on `python` (or the agent's) and seeing its packages; the workers run in it. None: none.")
    restartable: bool = Field(
        default=False,
        description="The job's workers restart in process (worker_runtime.run_restartable): torchrun runs per node "
        "as a local supervisor only, the rank shim sets the global RANK/WORLD_SIZE and TRAINYARD_RENDEZVOUS, and "
        "a stop order for a part whose workers are all alive parks them (state parked) for a handover.")
    adopts: str | None = Field(
        default=None, max_length=128,
        description="The earlier attempt whose parked part on this node (on exactly these GPUs) this part takes "
        "over: its workers are handed this attempt's assignment instead of being started. None: a cold start.")
    memory: MemoryTierSpec | None = Field(
        default=None,
        description="The in-memory checkpoint tier of this part: the job's memory secret, the peer agent that "
        "keeps a copy of its shards, where the previous attempt's copies may be, and the job's memory grant "
        "at each of those agents; None: off.",
    )
    launched: bool = Field(
        default=False,
        description="An agent already reported this part as started (perhaps a previous agent instance "
        "of this node): never start it again; adopt it from the work dir or leave it to be failed.",
    )
    storage: dict[str, Any] = Field(
        default_factory=dict,
        description="How workers reach checkpoint storage: `access`, `ca_pem` and the job's `prefix`, passed "
        "to workers as TRAINYARD_STORAGE_ACCESS, TRAINYARD_S3_CA_PEM and TRAINYARD_CHECKPOINT_PREFIX. To an "
        "agent that reports `known`, only `prefix`: the rest came in the RegisterResponse.",
    )
    version: str = Field(
        default="",
        description="Etag of this spec (a digest of its content, credentials excluded): the agent "
        "reports it back in HeartbeatRequest.known and gets the spec again only when it changes.",
    )


class AssignmentRef(_Wire):
    """An assignment the agent already holds at this version: run it (or keep it), or stop it."""

    attempt_id: str
    desired: Literal["run", "stop"]
    version: str
    handover_ok: bool = Field(
        default=False, description="With desired 'stop': the part may be parked for the job's next attempt to take "
        "over (a restartable job recovering from another node's failure); otherwise it is stopped at once.")


class HeartbeatResponse(_Wire):
    node_id: str
    node_state: str
    assignments: list[LaunchSpec] = Field(
        default_factory=list,
        description="Attempts this node must run, as full specs (for an agent that reports `known`: "
        "only the new or changed ones). Any local attempt neither here nor in `unchanged` with "
        "desired 'run' must be stopped.",
    )
    unchanged: list[AssignmentRef] = Field(
        default_factory=list,
        description="The agent's known specs that are unchanged: 'run' (still assigned) or 'stop'.",
    )
    heartbeat_interval_s: float


class WaitRequest(_Wire):
    """``POST /v1/agent/wait``: a long poll. Answered as soon as the node's desired state differs
    from ``known`` (a new or changed assignment, a stop order), or after ``timeout_s`` (at most the
    control plane's ``agent_wait_timeout_s``) with ``changed`` false. With ``answer``, a change comes
    with the node's desired state, as a heartbeat answer would carry it, and the agent applies it
    at once; without, the agent heartbeats at once when ``changed``. Either way it then waits again."""

    known: list[KnownAssignment] = Field(default_factory=list, max_length=1024)
    timeout_s: float | None = Field(
        default=None, gt=0, le=120,
        description="Seconds to wait for a change, over 0 to 120 (capped by agent_wait_timeout_s); null: that.")
    answer: bool = Field(
        default=False,
        description="Answer a change with `assignments` and `unchanged` (as HeartbeatResponse, relative "
        "to `known`), so that no heartbeat is needed to learn it. An agent applies such an answer like a "
        "heartbeat's, except that it never stops an attempt it launched after sending the request (the "
        "answer was read before that attempt was known to it).",
    )


class WaitResponse(_Wire):
    changed: bool = Field(description="The node's desired state changed (or may have): heartbeat now, or "
                          "apply `assignments` and `unchanged` when they are given.")
    assignments: list[LaunchSpec] | None = Field(
        default=None, description="With `answer` and `changed`: new or changed specs, as in HeartbeatResponse.")
    unchanged: list[AssignmentRef] | None = Field(
        default=None, description="With `answer` and `changed`: the known specs, 'run' or 'stop'.")


class WorkerState(StrEnum):
    starting = "starting"
    running = "running"
    exited = "exited"


class WorkerStatus(_Wire):
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    local_rank: Int32 = Field(description="Rank on its node (LOCAL_RANK), 0 to 2,147,483,647.")
    pid: int | None = Field(default=None, ge=0, le=INT32_MAX, description="Process id, 0 to 2,147,483,647.")
    state: WorkerState
    exit_code: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX,
                                  description="Negative: killed by that signal.")
    started_at: datetime | None = None
    ended_at: datetime | None = None
    cause: str | None = Field(
        default=None, max_length=32, pattern=r"^[a-z_]+$", description="Why a non-zero exit happened: one of "
        f"{', '.join(FAILURE_KINDS)} (trainyard.protocol.exits), from the worker's own stderr; set by the rank shim.")
    message: Annotated[str | None, _clip(MAX_MESSAGE_CHARS)] = Field(
        default=None, description="The worker's own words for it, e.g. the exception's type and text.")


class NodeAttemptState(StrEnum):
    launching = "launching"  # torchrun started, workers not all up yet
    running = "running"
    exited = "exited"  # torchrun exited by itself (see exit_code)
    stopped = "stopped"  # stopped by the agent because the control plane asked
    parked = "parked"  # told to stop, a restartable part's workers alive and waiting for the next attempt


Metrics = Annotated[dict[Annotated[str, Field(max_length=128, pattern=TEXT_LINE)], Finite],
                    Field(max_length=MAX_METRICS)]


class Progress(_Wire):
    step: Int32 = Field(description="Training step, 0 to 2,147,483,647.")
    loss: Finite | None = Field(default=None,
                                description="Training loss at that step: any finite number (the worker runtime sends "
                                "no inf or NaN; they are refused).")
    at: datetime
    metrics: Metrics = Field(default_factory=dict)
    total_steps: Int32 | None = Field(default=None, description="The steps the script will run, when it says.")


FencingToken = Annotated[str, Field(min_length=1, max_length=128)]


RANK_SILENT_AFTER_S = 3.0
"""A rank that has sent nothing to its agent for this long is listed as silent. Workers report at
least every REPORT_KEEPALIVE_S, also while blocked in a collective (from a thread): a rank that is
silent is stopped or frozen, not waiting for a peer."""
REPORT_KEEPALIVE_S = 1.0
CHECKPOINT_AUTO_FIRST_STEPS = 100
"""An 'auto' job's checkpoint interval before the platform chose one (unless the job's
``first_interval_steps`` says otherwise)."""
MAX_NODE_RANKS = 256
"""The most ranks one node's summary lists: a node's own ranks, never the job's world."""


Seconds = Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)]


class RankStat(_Wire):
    """One local rank as its agent saw it (worker_runtime/reporting.py sends the figures)."""

    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    step: Int32 = Field(description="Training step, 0 to 2,147,483,647.")
    step_time_s: Seconds | None = Field(default=None, description="Wall seconds per step, lately.")
    busy_s: Seconds | None = Field(
        default=None, description="Seconds per step the rank computed on its own (outside collectives), "
        "lately; what tells a slow rank from one that waits for it.")
    silent_s: Seconds = Field(description="Seconds since the rank last reported anything.")
    stalled_s: Seconds = Field(description="Seconds since its step last advanced.")


class RankSummary(_Wire):
    """A node's ranks of an attempt: it grows with the node's own ranks, never with the world size."""

    ranks: list[RankStat] = Field(default_factory=list, max_length=MAX_NODE_RANKS)


AgentErrorKind = Literal["start_error", "launch_error", "resource_limit"]
"""The failure kinds an agent may name for its part's error (trainyard.protocol.exits)."""


class AttemptStatusReport(_Wire):
    fencing_token: FencingToken
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")
    state: NodeAttemptState
    exit_code: int | None = Field(default=None, ge=-INT32_MAX, le=INT32_MAX,
                                  description="torchrun's exit code once exited.")
    workers: list[WorkerStatus] = Field(default_factory=list, max_length=4096)
    progress: Progress | None = None
    result: JsonDocument | None = Field(default=None, description="Reported by global rank 0 at the end.")
    error: Annotated[str | None, _clip(MAX_MESSAGE_CHARS)] = Field(
        default=None, description="Why the agent could not launch or run it.")
    error_kind: AgentErrorKind | None = Field(
        default=None, description="What kind of failure `error` is, when the agent knows: start_error (the job's "
        "own setup cannot work, e.g. its requirements do not install: not retried) or launch_error (this node "
        "could not launch it). None: the control plane classifies it.")
    ranks: RankSummary | None = Field(
        default=None, description="The node's ranks' steps, step and busy times and silences (watchdogs); sent "
        "with the periodic report, not with every step.")
    received_s_ago: Seconds | None = Field(
        default=None, description="Seconds since the agent received this part, by its own monotonic clock, when it "
        "sent the report: the control plane subtracts it from its own clock (a node's wall clock may be off). "
        "The wake-up phase of a recovery ends at the last node's.")
    initialized_s_ago: Seconds | None = Field(
        default=None, description="Seconds since the last of the node's ranks said its process group is "
        "initialised (POST .../ready of the local API), once all of them did; measured as received_s_ago. The "
        "rendezvous phase of a recovery ends at the last node's.")
    processes_alive: bool | None = Field(
        default=None,
        description="False only in a final report (exited or stopped) when the agent found no process of "
        "the attempt left on the node: the control plane releases the part's GPUs on this report rather "
        "than at the next heartbeat. None (or true): the heartbeat that no longer lists the attempt "
        "releases them.",
    )

    @model_validator(mode="after")
    def _gone_only_when_final(self) -> AttemptStatusReport:
        if self.processes_alive is False and self.state not in (NodeAttemptState.exited, NodeAttemptState.stopped):
            raise ValueError("processes_alive may be false only in a final report (state exited or stopped)")
        return self


class AttemptStatusAck(_Wire):
    attempt_state: str
    stop: bool = Field(description="True when the agent must stop this attempt's processes.")
    handover_ok: bool = Field(
        default=False, description="With stop: the part may be parked for the job's next attempt to take over (a "
        "restartable job recovering from another node's failure); otherwise it is stopped at once.")
    checkpoint_interval_steps: int | None = Field(
        default=None, ge=1, description="For a job whose checkpoint interval is 'auto': the interval the platform "
        "chose now; the agent serves it to its workers (local API), which agree on it at their next save.")
    released: bool = Field(
        default=False,
        description="The part's GPUs are released (the report said no process is left, or a heartbeat "
        "confirmed it before): the node's next heartbeat has nothing more to confirm for it.",
    )


class LogChunk(_Wire):
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    stream: str = Field(pattern="^(stdout|stderr)$")
    offset: Int64 = Field(description="Byte offset of data in that rank's stream.")
    data: str = Field(max_length=MAX_LOG_CHUNK_CHARS, description="NUL characters are dropped when stored.")


class LogBatch(_Wire):
    fencing_token: FencingToken
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")
    chunks: list[LogChunk] = Field(max_length=4096)


class LogAck(_Wire):
    accepted: int


# --- Worker <-> agent local API (served by the agent on a unix socket per attempt) ---
#
# Workers learn the socket from TRAINYARD_AGENT_SOCKET (and the base URL from TRAINYARD_AGENT_URL)
# and authenticate with the attempt's fencing token (TRAINYARD_FENCING_TOKEN). An unknown or stale
# attempt gets 409; a number that is not finite (NaN, Infinity) anywhere in a body gets 422.
#
# - POST /v1/local/attempts/{attempt_id}/progress  LocalProgress
# - POST /v1/local/attempts/{attempt_id}/result    LocalResult


class LocalProgress(_Wire):
    """Every rank sends it: global rank 0 with its loss and metrics (the attempt's progress), the
    others with their step and timings only (the node's RankSummary)."""

    fencing_token: FencingToken
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    step: Int32 = Field(description="Training step, 0 to 2,147,483,647.")
    loss: Finite | None = Field(default=None,
                                description="Training loss at that step: any finite number (the worker runtime sends "
                                "no inf or NaN; they are refused).")
    metrics: Metrics = Field(default_factory=dict)
    total_steps: Int32 | None = Field(default=None, description="The steps the script will run, when it says.")
    step_time_s: float | None = Field(default=None, ge=0, le=1e7, allow_inf_nan=False,
                                      description="Wall seconds per step since the last report.")
    busy_s: float | None = Field(default=None, ge=0, le=1e7, allow_inf_nan=False,
                                 description="Seconds per step spent computing alone.")


class LocalReady(_Wire):
    """``POST /v1/local/attempts/{id}/ready``: this rank's process group is initialised (the end of
    a recovery's rendezvous phase; worker_runtime/distributed.py sends it)."""

    fencing_token: FencingToken
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")


class LocalCheckpointInterval(_Wire):
    """``POST /v1/local/attempts/{id}/checkpoint-interval``: the interval the platform chose for an 'auto'
    job (answer: ``{"interval_steps": N | null}``)."""

    fencing_token: FencingToken


class LocalResult(_Wire):
    fencing_token: FencingToken
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    result: JsonDocument


# The environment given to every worker process is in trainyard/protocol/env.py (standard
# library only, so the rank shim imports it without pydantic).


# --- Checkpoint shards and worker events (two-phase checkpoints, docs/architecture.md) ---
#
# Worker -> agent (local API):
# - POST /v1/local/attempts/{attempt_id}/shards  LocalShard   (after the shard is uploaded)
# - POST /v1/local/attempts/{attempt_id}/events  LocalEvent   (checkpoint restored/fallback/failed)
# Agent -> control plane (node token; 409 problem+json when the attempt is stale):
# - POST /v1/agent/attempts/{attempt_id}/shards  ShardReport -> ShardAck
# - POST /v1/agent/attempts/{attempt_id}/events  WorkerEventBatch -> WorkerEventAck
# Shards are keyed by (attempt, step, rank): a resent shard is stored once.


class ShardInfo(_Wire):
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    step: Int32 = Field(description="Training step, 0 to 2,147,483,647.")
    world_size: int = Field(ge=1, le=INT32_MAX, description="Ranks of the save, 1 to 2,147,483,647.")
    key: str = Field(min_length=1, max_length=1024,
                     description="Object key of the uploaded shard: exactly keys.shard_key of its job, step, "
                     "attempt and rank.")
    size_bytes: Int64 = Field(description="Bytes of the shard, 0 to 2^63 - 1.")
    sha256: str = Field(pattern="^[0-9a-f]{64}$")
    upload: UploadStats | None = Field(default=None, description="Its upload's slot wait and duration "
                                       "(trainyard/protocol/uploads.py); None from an older worker runtime.")
    blocking_s: float | None = Field(
        default=None, ge=0, le=86400, description="How long this save blocked the rank's training loop.")
    background_s: float | None = Field(
        default=None, ge=0, le=86400, description="Hashing, upload and report after the loop went on.")


class LocalShard(ShardInfo):
    fencing_token: FencingToken


class ShardReport(_Wire):
    fencing_token: FencingToken
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")
    shards: list[ShardInfo] = Field(max_length=4096)


class ShardAck(_Wire):
    accepted: int
    committed_steps: list[int] = Field(default_factory=list, description="Steps now committed.")


WORKER_CHECKPOINT_EVENTS = frozenset({
    "checkpoint.restored", "checkpoint.fallback", "checkpoint.save_failed", "checkpoint.restore_failed",
    "checkpoint.skipped", "checkpoint.upload_unslotted",
})
"""The only checkpoint.* kinds a worker may send: facts about its own restore and saves (every kind
worker_runtime/checkpoint/notify.py sends). The others (checkpoint.committed, .aborted, .deleted,
...) are the control plane's to write. Any other kind is stored as ``worker.<kind>``, so it cannot
pass for a control-plane event either."""


class WorkerEvent(_Wire):
    rank: Int32 = Field(description="Global rank of the worker, 0 to 2,147,483,647.")
    kind: str = Field(pattern=r"^[a-z][a-z0-9_.]*$", max_length=64,
                      description="checkpoint.restored, checkpoint.fallback, checkpoint.save_failed, "
                      "checkpoint.restore_failed, checkpoint.skipped, checkpoint.upload_unslotted, or a kind of "
                      "the worker's own (stored as worker.<kind>)")
    message: Text = Field(max_length=MAX_MESSAGE_CHARS)
    data: JsonDocument = Field(default_factory=dict)
    at: datetime | None = None

    @field_validator("kind")
    @classmethod
    def _kind(cls, kind: str) -> str:
        if kind.startswith("checkpoint.") and kind not in WORKER_CHECKPOINT_EVENTS:
            raise ValueError(f"{kind!r} is a control-plane event; workers send only "
                             f"{', '.join(sorted(WORKER_CHECKPOINT_EVENTS))} or kinds of their own")
        return kind


class LocalEvent(WorkerEvent):
    fencing_token: FencingToken


class WorkerEventBatch(_Wire):
    fencing_token: FencingToken
    node_rank: Int32 = Field(description="The node's rank in the attempt (torchrun's node_rank), 0 to 2,147,483,647.")
    events: list[WorkerEvent] = Field(max_length=4096)


class WorkerEventAck(_Wire):
    accepted: int
