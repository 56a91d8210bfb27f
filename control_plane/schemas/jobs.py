"""Request and response models of the jobs API."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from control_plane.schemas.goodput import GoodputOut, StragglerOut
from control_plane.schemas.limits import TEXT_LINE
from control_plane.schemas.plans import JobModelIn, JobPlanOut
from control_plane.schemas.scheduling import ReservationOut
from control_plane.schemas.tenants import TENANT_NAME
from control_plane.schemas.uploads import CheckpointUploadOut
from trainyard.protocol.agent import MAX_COMMAND_ITEM_CHARS, MAX_COMMAND_ITEMS, CommandItem
from trainyard.protocol.env import MAX_JOB_ENV_BYTES, job_env_bytes, job_env_problem
from trainyard.protocol.interpreters import python_path_problem
from trainyard.protocol.layout import APPLIED_KINDS, Layout
from trainyard.protocol.requirements import MAX_REQUIREMENTS_CHARS, requirements_problem

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


# Documented as a one-value enum, not a const: generated clients (openapi-python-client) parse a
# const member of a union without falling back to the union's other members, so 50 failed there.
AutoInterval = Annotated[Literal["auto"], WithJsonSchema({"type": "string", "enum": ["auto"]})]


class CheckpointSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    interval_steps: Annotated[int, Field(ge=1, le=10_000_000)] | AutoInterval | None = Field(
        default=None, description="Save a complete checkpoint every N steps (1 to 10,000,000), or 'auto': the "
        "platform sets the interval by the Young/Daly rule from the job's measured save cost and the cluster's "
        "failure rate, and changes it as measurements arrive (docs/goodput.md).")
    first_interval_steps: int | None = Field(
        default=None, ge=1, le=10_000_000, description="With 'auto': the interval until the platform has measured "
        "a save (default 100 steps).")
    keep_last: int = Field(default=3, ge=1, le=1000, description="Committed checkpoints to keep.")
    when_busy: Literal["wait", "skip"] = Field(
        default="wait", description="When a save comes while the previous one is still uploading: wait for it "
        "(training blocks), or skip this save (a checkpoint.skipped event).")
    memory_tier: bool = Field(
        default=True, description="Keep each rank's latest shard in its node agent's memory and a copy on a peer "
        "node, so that a restore reads memory before S3 (docs/architecture.md, 'In-memory checkpoint tier'). "
        "false: workers never hand shards to their agent (no second copy crosses the network) and every "
        "restore reads S3.")


_BUDGET = "Seconds the {} phase of a recovery may take, 0.1 to 86,400; null: the cluster's."


class RecoveryBudgets(BaseModel):
    """A job's budget for each phase of a recovery, in seconds (null: the cluster's)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    # At least a tenth of a second: a budget of 5e-324 s is no budget a phase can meet or be measured against.
    detection: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("detection"))
    decision: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("decision"))
    wake_up: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("wake_up"))
    process_start: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("process_start"))
    rendezvous: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("rendezvous"))
    restore: float | None = Field(default=None, ge=0.1, le=86400, description=_BUDGET.format("restore"))


class WatchdogSettings(BaseModel):
    """The job's own watchdog settings; each null takes the cluster's (TRAINYARD_HANG_*, _STRAGGLER_*)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    hang_timeout_s: float | None = Field(
        default=None, ge=1, le=7 * 86400, description="Fail a running attempt as hung when its step has not "
        "advanced for this long (default: derived from its step time and checkpoint stalls, with a floor).")
    straggler_factor: float | None = Field(
        default=None, gt=1, le=100, description="A rank this many times slower than its peers' median is named.")
    avoid_stragglers: bool = Field(
        default=False, description="The next recovery does not place the job on a node named a straggler.")
    recovery_budget_s: RecoveryBudgets | None = Field(
        default=None, description="This job's own recovery budgets, phase by phase (seconds); a phase left out "
        "takes the cluster's. A recovery over budget writes a recovery.over_budget event.")


class CodeIn(BaseModel):
    """Code uploaded with PUT /v1/code/{sha256} (what `trainyard run` does with a job file's
    `workdir`): the workers run in it, unpacked on each node, and the entrypoint is resolved inside it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    sha256: str = Field(pattern="^[0-9a-f]{64}$", description="sha256 of the uploaded archive (tar.gz).")


class CodeOut(BaseModel):
    sha256: str
    size_bytes: int


class JobSubmit(BaseModel):
    """A training job: `num_nodes` x `gpus_per_node` workers started together."""

    # strict: a JSON true is not a number here ("priority": false was accepted as 0).
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [SUBMIT_EXAMPLE]})

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    num_nodes: int = Field(ge=1, le=4096, description="Nodes the job spans (one torchrun each).")
    gpus_per_node: int = Field(ge=1, le=64, description="GPUs (workers) per node.")
    entrypoint: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="Python module (run as `torchrun -m MODULE`) or a path to a `.py` file. Give either this "
        "or `command`.",
    )
    command: list[CommandItem] | None = Field(
        default=None, min_length=1, max_length=MAX_COMMAND_ITEMS,
        description=f"The job's own command (argv, not a shell line), run once on every node in place of "
        f"Trainyard's torchrun: a shell script, a launcher of its own, `python -m torch.distributed.run` with its "
        f"own flags. It gets the node rank, node count, processes per node, the rendezvous address and port "
        f"(docs/writing-jobs.md, \"Jobs that bring their own launcher\"). argv[0]: a name looked up on PATH on "
        f"the node (as the job's uid), an absolute path, or a path relative to the job's code. 1 to "
        f"{MAX_COMMAND_ITEMS} items of 1 to {MAX_COMMAND_ITEM_CHARS} characters, no NUL. Not with "
        f"`entrypoint`, `args` or `restartable`.",
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
    watchdog: WatchdogSettings | None = Field(default=None, description="Hang and straggler detection overrides.")
    max_failures: int = Field(
        default=3, ge=0, le=1000, description="Failed attempts tolerated; one more fails the job."
    )
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="Higher is served first; at most the tenant's max_priority (admins: any).")
    tenant: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=TENANT_NAME,
        description="Default: the caller's tenant. Only an admin may name another (403 otherwise).")
    time_limit_s: int | None = Field(default=None, ge=1, le=365 * 86400,
                                     description="Seconds an attempt may run from its allocation, 1 to "
                                     "31,536,000 (a year); null: no limit.")
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
    code: CodeIn | None = Field(default=None, description=(
        "Code to run in (uploaded before with PUT /v1/code/{sha256}); default: the code on the nodes."))
    python: str | None = Field(default=None, min_length=2, max_length=1024, pattern=r"^/[^\x00-\x1f]*$",
                               description=(
        "The Python interpreter on the nodes that runs torchrun and the workers (an absolute path, e.g. "
        "a venv's /opt/envs/llm/bin/python with torch and trainyard[worker]); default: the agent's."))
    requirements: str | None = Field(default=None, min_length=1, max_length=MAX_REQUIREMENTS_CHARS, description=(
        "A pip requirements file (its text): each node installs it, from wheels only, into a virtualenv "
        "cached per content hash (of the requirements, the interpreter and the node's constraints) that "
        "sees the interpreter's own packages (torch included); the workers run in it. No -r, -c, -e, "
        "--no-binary or --only-binary lines; packages by name only (no URL, path or 'name @ url'). "
        "`trainyard run` reads a job file's `requirements_file`."))
    restartable: bool = Field(default=False, description=(
        "The script runs its loop with worker_runtime.run_restartable: when a peer fails, the workers on healthy "
        "nodes stay alive and are handed over to the next attempt on the same GPUs (restarting in process), "
        "and only the failed node's ranks start cold. Default: every worker starts cold after a failure."))
    retry_same_exception: bool = Field(default=False, description=(
        "Retry an attempt that failed with the same exception, at the same step, as the attempt before it. "
        "Default: such a failure ends the job (it would fail the same way again), with a reason that says so."))

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

    @field_validator("python")
    @classmethod
    def _python(cls, v: str | None) -> str | None:
        # A path any user can write is refused now; the node decides the rest at launch.
        if v is not None and (problem := python_path_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, v: str | None) -> str | None:
        if v is not None and (problem := requirements_problem(v)) is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _entrypoint_or_command(self) -> JobSubmit:
        # Either torchrun runs the job's Python entrypoint, or the job's command runs in its place.
        if self.command is not None:
            if self.entrypoint is not None or self.args:
                raise ValueError("give either `command` or `entrypoint` (with `args`), not both: a command is run "
                                 "in place of torchrun and the entrypoint")
            if self.restartable:
                raise ValueError("a `command` job cannot be `restartable`: its processes are its own launcher's")
        elif self.entrypoint is None:
            raise ValueError("give `entrypoint` (a Python module or .py file run by torchrun) or `command` (argv)")
        return self

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, v: str | None) -> str | None:
        if v is None:
            return None
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


class JobProgress(BaseModel):
    """The current attempt's progress as its workers report it."""

    step: int | None = None
    loss: float | None = None
    updated_at: datetime | None = Field(default=None, description="Time of the last report.")
    total_steps: int | None = Field(default=None, description="The steps the script will run, when it says.")
    steps_per_s: float | None = Field(default=None, description="Step rate of the current attempt, smoothed.")
    eta_s: float | None = Field(default=None, description="(total_steps - step) / steps_per_s, when both are known.")
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
    entrypoint: str = Field(description="Empty for a `command` job.")
    args: list[str]
    command: list[str] | None = Field(default=None, description="The job's own command (argv); null: torchrun "
                                      "runs `entrypoint`.")
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
    code: CodeOut | None = Field(default=None, description="The shipped code its workers run in, if any.")
    python: str | None = Field(default=None, description="The interpreter its workers run with, if not the agent's.")
    requirements: str | None = Field(default=None, description="The requirements installed for its workers, if any.")
    restartable: bool = Field(default=False, description="Its healthy workers restart in process after a failure.")
    retry_same_exception: bool = Field(
        default=False, description="An exception raised again at the same step is retried (default: the job fails).")
    progress: JobProgress
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
    watchdog: dict[str, Any] | None = Field(default=None, description="The job's watchdog overrides.")
    checkpoint_interval: dict[str, Any] | None = Field(
        default=None, description="For interval_steps 'auto': the interval the platform chose and its inputs.")
    stragglers: list[StragglerOut] = Field(
        default_factory=list,
        description="Ranks of the current attempt named slower than their peers, with their node.")
    goodput: GoodputOut | None = Field(
        default=None, description="Allocated GPU-time and what it bought (docs/goodput.md).")
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
    cause: str | None = Field(default=None, description="Why a non-zero exit happened (see AttemptOut.failure_kind).")
    message: str | None = Field(default=None, description="The worker's own words for it (the end of its stderr).")


class AttemptPartOut(BaseModel):
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


class RecoveryOverrunOut(BaseModel):
    phase: str = Field(description="detection, decision, wake_up, process_start, rendezvous or restore.")
    seconds: float
    budget_s: float


class RecoveryOut(BaseModel):
    """How this attempt took over from the failed one before it, phase by phase (docs/architecture.md,
    "Recovery phases"). Durations in seconds. A phase not reached yet is null; so is one whose end
    was not reported (an older agent, a script without the runtime's init_distributed): its time
    then counts in the next phase. The phases that are not null add up to to_first_step_s."""

    after_attempt: int = Field(description="Number of the failed attempt this one replaced.")
    failure_at: datetime = Field(description="First evidence of the failure (a worker's exit, or the decision).")
    detection_s: float | None = Field(description="Failure -> the control plane failed the attempt.")
    decision_s: float | None = Field(description="Failed -> this attempt created (its gang placed).")
    wake_up_s: float | None = Field(description="Created -> every node's agent had its part (the agents' own "
                                    "monotonic clocks, as ages: a skewed node clock does not move it).")
    process_start_s: float | None = Field(description="Received -> every worker process running.")
    rendezvous_s: float | None = Field(
        description="Running -> every rank's process group initialised (the script's imports, then the rendezvous).")
    restore_s: float | None = Field(
        description="Initialised -> the first step reported: loading the checkpoint, then one step.")
    to_first_step_s: float | None = Field(description="Failure -> this attempt's first step reported.")
    steps_lost: int | None = Field(description="Steps the failed attempt had reported beyond the restored step.")
    budget_s: dict[str, float] = Field(
        default_factory=dict, description="Each phase's budget (the job's watchdog.recovery_budget_s over the "
        "cluster's TRAINYARD_RECOVERY_BUDGET_*_S); a phase without one is absent.")
    over_budget: list[RecoveryOverrunOut] = Field(
        default_factory=list, description="The phases that took longer than their budget (in order).")


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
    hung_since: datetime | None = Field(default=None, description="Failed as hung: when its step last advanced.")
    progress_metrics: dict[str, float] = Field(description="The metrics of that report (see JobProgress.metrics).")
    failure_kind: str | None = Field(default=None, description=(
        "Why a failed attempt failed: start_error (the script could not start: import or syntax error, missing "
        "file or module), exception (a Python exception, type and message in end_reason), out_of_memory, "
        "signal (killed), collective_timeout (NCCL or gloo), exit_code (a plain non-zero exit), node_lost, "
        "launch_error, time_limit, or other."))
    recovery: RecoveryOut | None = Field(description="Set when this attempt replaced a failed one.")
    created_at: datetime
    started_at: datetime | None
    first_progress_at: datetime | None
    failed_at: datetime | None
    ended_at: datetime | None
    nodes: list[AttemptPartOut]


class ProgressSampleOut(BaseModel):
    attempt_number: int
    step: int
    loss: float | None
    steps_per_s: float | None
    metrics: dict[str, float]
    at: datetime


class ProgressPage(BaseModel):
    items: list[ProgressSampleOut] = Field(description="Oldest first.")
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page.")


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
    items: list[EventOut] = Field(description="Oldest first.")
    next_cursor: str | None = Field(description="Pass as `cursor` to get the next page; null at the end (to "
                                    "follow newer events later, pass the last item's id as `after`).")


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
    blocking_s: float | None = Field(default=None, description="The longest any rank's loop was blocked by this save.")
    background_s: float | None = Field(
        default=None, description="The longest any rank's serialise, hash, upload and report took in the background.")
    upload_bytes_per_s: float | None = Field(
        default=None, description="size_bytes / background_s: the ranks' uploads together.")
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
