"""Request and response models of the jobs API."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from control_plane.schemas.limits import TEXT_LINE
from control_plane.schemas.plans import JobModelIn, JobPlanOut
from control_plane.schemas.scheduling import ReservationOut
from control_plane.schemas.tenants import TENANT_NAME
from control_plane.schemas.uploads import CheckpointUploadOut
from trainyard.protocol.env import MAX_JOB_ENV_BYTES, job_env_bytes, job_env_problem
from trainyard.protocol.layout import APPLIED_KINDS, Layout

MAX_ENV_BYTES = MAX_JOB_ENV_BYTES
MAX_ARGS = 1000
MAX_ARG_CHARS = 32 * 1024
MAX_ARGS_BYTES = 64 * 1024

JOB_STATES = ("queued", "starting", "running", "recovering", "succeeded", "failed", "cancelling",
              "cancelled")

SUBMIT_EXAMPLE: dict[str, Any] = {
    "name": "tiny-gpt",
    "num_nodes": 2,
    "gpus_per_node": 2,
    "entrypoint": "worker_runtime.examples.tiny_gpt",
    "args": ["--steps", "300"],
    "checkpoint": {"interval_steps": 50},
    "max_failures": 3,
}


GpuKindName = Annotated[str, Field(min_length=1, max_length=128, pattern=TEXT_LINE)]
MAX_GPU_KINDS = 16


class CheckpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    interval_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Save a complete checkpoint every N steps."
    )
    keep_last: int = Field(default=3, ge=1, le=1000, description="Committed checkpoints to keep.")


class JobSubmit(BaseModel):
    """A training job: `num_nodes` x `gpus_per_node` workers started together."""

    # strict: a JSON true is not a number here ("priority": false was accepted as 0).
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [SUBMIT_EXAMPLE]})

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    num_nodes: int = Field(ge=1, le=4096, description="Nodes the job spans (one torchrun each).")
    gpus_per_node: int = Field(ge=1, le=64, description="GPUs (workers) per node.")
    entrypoint: str = Field(
        min_length=1,
        max_length=1024,
        description="Python module (run as `torchrun -m MODULE`) or a path to a `.py` file.",
    )
    args: list[Annotated[str, Field(max_length=MAX_ARG_CHARS)]] = Field(
        default_factory=list, max_length=MAX_ARGS,
        description=f"Arguments of the entrypoint: at most {MAX_ARGS}, each at most {MAX_ARG_CHARS} characters, "
        f"{MAX_ARGS_BYTES} bytes in all, no NUL.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environment of the training processes (not of torchrun). Refused: TRAINYARD_*, "
        "PET_*, TORCHELASTIC_*, torchrun's rank variables, the GPU selection, HOME, TMPDIR, USER, LOGNAME, "
        "PATH, LD_PRELOAD, LD_AUDIT, PYTHONHOME. PYTHONPATH is appended to the platform's. At most "
        f"{MAX_ENV_BYTES} bytes (NAME=value and a NUL each), or the server's max_env_bytes if lower.",
        json_schema_extra={"maxProperties": MAX_ENV_BYTES // 3},
    )
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    max_failures: int = Field(
        default=3, ge=0, le=1000, description="Failed attempts tolerated; one more fails the job."
    )
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="Higher is served first; at most the tenant's max_priority (admins: any).")
    tenant: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=TENANT_NAME,
        description="Default: the caller's tenant. Only an admin may name another (403 otherwise).")
    time_limit_s: int | None = Field(default=None, ge=1, le=365 * 86400)
    gpu_kind: GpuKindName | Annotated[list[GpuKindName], Field(min_length=1, max_length=MAX_GPU_KINDS)] | None = Field(
        default=None,
        description="Require this GPU kind, or one of a list of kinds (the whole gang runs on one of them). "
        "Without it the job may run on any kind.",
    )
    model: JobModelIn | None = Field(default=None, description=(
        "What the job trains: the job is planned at submit (docs/planner.md), refused (422, with the numbers) "
        "when its layout does not fit in GPU memory, and warned about (an event) when fewer GPUs would do "
        "better. The plan is shown with the job."))
    layout: Layout | None = Field(default=None, description=(
        "The parallel layout the workers apply (TRAINYARD_LAYOUT); default: DDP without accumulation."))

    @field_validator("gpu_kind")
    @classmethod
    def _gpu_kind(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            v = list(dict.fromkeys(v))  # the same kind twice says nothing more
            return v[0] if len(v) == 1 else v
        return v

    def gpu_kinds(self) -> list[str] | None:
        """The accepted kinds as a list (None: any)."""
        if self.gpu_kind is None:
            return None
        return [self.gpu_kind] if isinstance(self.gpu_kind, str) else list(self.gpu_kind)

    @field_validator("layout")
    @classmethod
    def _layout(cls, layout: Layout | None, info: ValidationInfo) -> Layout | None:
        if layout is None:
            return None
        if layout.kind not in APPLIED_KINDS:
            raise ValueError(f"layout {layout.kind} is planned only: the worker runtime applies "
                             f"{', '.join(sorted(APPLIED_KINDS))} (POST /v1/plans plans {layout.kind})")
        if layout.compression != "none" and layout.kind != "ddp":
            raise ValueError(f"gradient compression applies to ddp only, not {layout.kind}")
        if layout.kind == "hsdp" and layout.shard_size is not None:
            node = info.data.get("gpus_per_node")
            nodes = info.data.get("num_nodes")
            if node is None or nodes is None:
                return layout  # those fields are invalid themselves: their errors say so
            size, gpus = layout.shard_size, nodes * node
            whole = node % size == 0 if size <= node else size % node == 0
            if gpus % size or not whole:
                raise ValueError(f"hsdp shard_size {size} must divide the job's {gpus} GPUs and be a divisor "
                                 f"or a multiple of gpus_per_node {node}")
        return layout

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, v: str) -> str:
        v = v.strip()
        if not v:
            raise ValueError("entrypoint must name a Python module or a .py file")
        if any(c in v for c in "\0\n\r"):
            raise ValueError("entrypoint must not contain control characters")
        if not v.endswith(".py") and not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", v):
            raise ValueError(f"entrypoint {v!r} is neither a dotted module name nor a path to a .py file")
        return v

    @field_validator("args")
    @classmethod
    def _args(cls, v: list[str]) -> list[str]:
        for arg in v:
            if "\0" in arg:
                raise ValueError("args must not contain NUL characters")
        size = sum(len(a.encode()) for a in v)
        if size > MAX_ARGS_BYTES:
            raise ValueError(f"args are {size} bytes; at most {MAX_ARGS_BYTES} are allowed")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            problem = job_env_problem(key, value)
            if problem is not None:
                raise ValueError(problem)
        size = job_env_bytes(v)
        if size > MAX_ENV_BYTES:
            raise ValueError(f"env is {size} bytes; at most {MAX_ENV_BYTES} are allowed")
        return v


class Progress(BaseModel):
    step: int | None = None
    loss: float | None = None
    updated_at: datetime | None = Field(default=None, description="Time of the last report.")
    metrics: dict[str, float] = Field(default_factory=dict, description=(
        "The current attempt's last reported metrics: the measured split of a step, in seconds per "
        "optimizer step and bytes (step_s, compute_s, comm_s: exposed communication, comm_busy_s, "
        "comm_bytes; means over ranks and over the steps since the previous report), and whatever "
        "else the script reports (lr, ...)."))


class StepSplitOut(BaseModel):
    """One optimizer step split into compute and exposed (not overlapped) communication, seconds."""

    step_s: float
    compute_s: float
    comm_s: float
    comm_share: float = Field(description="comm_s / step_s.")


class SplitOut(BaseModel):
    """The plan's predicted step next to the step the workers measured."""

    predicted: StepSplitOut | None = Field(description="From the plan's row for the job's own count "
                                           "(compute_s, exposed_comm_s, step_s); null without a plan.")
    measured: StepSplitOut | None = Field(description="From the current attempt's progress.metrics; null until "
                                          "the workers report them.")
    step_ratio: float | None = Field(description="measured / predicted step time.")


class AttemptRef(BaseModel):
    id: str
    number: int
    state: str
    outcome: str | None = None


class AllocationEntry(BaseModel):
    node_id: str
    node_name: str
    node_rank: int
    gpu_indices: list[int]


class JobOut(BaseModel):
    id: str
    name: str
    tenant: str
    priority: int
    state: str = Field(description="One of: " + ", ".join(JOB_STATES))
    num_nodes: int
    gpus_per_node: int
    entrypoint: str
    args: list[str]
    env: dict[str, str]
    checkpoint: dict[str, Any]
    max_failures: int
    failures: int
    time_limit_s: int | None
    gpu_kind: str | list[str] | None = Field(description="The GPU kind the job requires, or the list of kinds it "
                                             "accepts; null: any.")
    allocated_gpu_kind: str | None = Field(
        default=None, description="The GPU kind its current (or last) attempt got: a gang runs on one kind."
    )
    model: dict[str, Any] | None = Field(default=None, description="The model block the job was submitted with.")
    layout: Layout | None = Field(default=None, description="The layout its workers apply (null: plain DDP).")
    plan: JobPlanOut | None = Field(default=None, description="The plan made at submit, when the job has a model.")
    progress: Progress
    split: SplitOut = Field(description="The measured split of a step next to the plan's prediction.")
    result: dict[str, Any] | None
    end_reason: str | None
    current_attempt: AttemptRef | None
    allocation: list[AllocationEntry]
    reservation: ReservationOut | None = Field(
        default=None, description="The nodes held for this waiting job, when it holds a reservation."
    )
    waiting_for: str | None = Field(
        default=None, description="What a queued, recovering, starting or cancelling job waits for, e.g. "
        "'no node with GPU kind h100', 'needs 4 nodes with 8 free GPUs, the cluster has 2 such nodes now', "
        "'reservation on nodes ..., earliest start ...', 'quota: ...', 'node gpu-3 to confirm its workers stopped'."
    )
    leases_held: int = Field(
        default=0, description="GPU leases the job's attempts still hold. After the job ends they are held "
        "until each node confirms its processes gone (a lost node: until it returns or is removed)."
    )
    releasing: bool = Field(
        default=False, description="The job ended but its GPUs are not free yet (leases_held > 0)."
    )
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


class JobPage(BaseModel):
    items: list[JobOut]
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page.")



class WorkerOut(BaseModel):
    """One worker (rank) of a node's part. `state` only moves forward: starting < running < exited.
    Once the part is released (its node confirmed every process of it gone), a worker whose exit
    was never recorded is shown `exited` with `exit_code` null and `reason` saying so; a recorded
    exit has `reason` null."""

    rank: int
    local_rank: int
    pid: int | None
    state: str
    exit_code: int | None
    started_at: datetime | None
    ended_at: datetime | None
    reason: str | None = Field(default=None, description="Why an exit shows no exit code, if it does not.")


class AttemptNodeOut(BaseModel):
    node_id: str
    node_name: str
    node_rank: int
    gpu_indices: list[int]
    desired: str
    state: str
    exit_code: int | None
    error: str | None
    released_at: datetime | None
    workers: list[WorkerOut]


class RecoveryOut(BaseModel):
    """How this attempt took over from the failed one before it. Durations in seconds; a phase that
    has not happened yet is null."""

    after_attempt: int = Field(description="Number of the failed attempt this one replaced.")
    failure_at: datetime = Field(description="First evidence of the failure (a worker's exit, or the decision).")
    detection_s: float | None = Field(description="Failure -> the control plane failed the attempt.")
    reallocation_s: float | None = Field(description="Failed -> this attempt's gang was allocated.")
    start_s: float | None = Field(description="Allocated -> every worker running.")
    restore_s: float | None = Field(
        description="Every worker running -> the first step reported: loading the checkpoint, then one step.")
    to_first_step_s: float | None = Field(description="Failure -> this attempt's first step reported.")
    steps_lost: int | None = Field(description="Steps the failed attempt had reported beyond the restored step.")


class AttemptOut(BaseModel):
    id: str
    number: int
    state: str
    outcome: str | None
    end_reason: str | None
    failed_node: str | None = Field(description="The node blamed for the failure, if one is.")
    rendezvous: str
    restored_from_step: int | None
    progress_step: int | None = Field(description="The last step this attempt reported.")
    progress_metrics: dict[str, float] = Field(description="The metrics of that report (see Progress.metrics).")
    recovery: RecoveryOut | None = Field(description="Set when this attempt replaced a failed one.")
    created_at: datetime
    started_at: datetime | None
    first_progress_at: datetime | None
    failed_at: datetime | None
    ended_at: datetime | None
    nodes: list[AttemptNodeOut]


class EventOut(BaseModel):
    id: int
    kind: str
    message: str
    job_id: str | None
    attempt_id: str | None
    node_id: str | None
    data: dict[str, Any]
    created_at: datetime


class EventPage(BaseModel):
    items: list[EventOut]
    next_after: int | None = Field(description="Pass as `after` to get newer events.")


class CheckpointOut(BaseModel):
    id: str
    step: int
    attempt_id: str
    attempt_number: int
    state: str = Field(description="pending | committed | unusable (a restore found it bad) | aborted | deleted")
    world_size: int
    size_bytes: int
    shards: int = Field(description="Shards recorded so far.")
    manifest_key: str | None
    reason: str | None
    created_at: datetime
    committed_at: datetime | None
    upload: CheckpointUploadOut | None = Field(
        default=None, description="Its shards' upload slot waits and upload rate; null before any is reported.")

class AttemptPage(BaseModel):
    items: list[AttemptOut] = Field(description="Oldest first.")
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page.")


class CheckpointPage(BaseModel):
    items: list[CheckpointOut] = Field(description="Newest first.")
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page.")
