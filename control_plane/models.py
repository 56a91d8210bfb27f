"""SQLAlchemy 2 models: the control plane's whole state lives here, in PostgreSQL.

Invariants the database itself enforces (see migrations and docs/architecture.md):
- a GPU has at most one active lease (partial unique index ``uq_gpu_leases_active_gpu``);
- an attempt's leases are all inserted in one transaction or none (deferred constraint trigger
  ``gpu_leases_gang_complete`` checks the count against ``attempts.num_gpus`` at commit);
- an active attempt's rendezvous port is unique (partial unique index).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Attempt states in which the attempt still owns GPUs on some node.
ACTIVE_ATTEMPT_STATES = ("starting", "running", "stopping")


def new_id() -> uuid.UUID:
    return uuid.uuid4()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _ts(nullable: bool = True, **kw: Any) -> Any:
    return mapped_column(DateTime(timezone=True), nullable=nullable, **kw)


class Node(Base):
    __tablename__ = "nodes"
    __table_args__ = (
        # Draining is a kind of not schedulable; uncordon clears both.
        CheckConstraint("NOT (draining AND schedulable)", name="drain_unschedulable"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    address: Mapped[str] = mapped_column(String(255), doc="Rendezvous address of the node.")
    state: Mapped[str] = mapped_column(String(16), doc="ready | lost | removed")
    schedulable: Mapped[bool] = mapped_column(
        Boolean, server_default=text("true"), doc="False once cordoned or draining: no new work."
    )
    draining: Mapped[bool] = mapped_column(
        Boolean, server_default=text("false"), doc="Drain asked: no new work, running jobs finish."
    )
    labels: Mapped[dict[str, str]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb"), doc="Topology labels the agent reports."
    )
    label_overrides: Mapped[dict[str, str]] = mapped_column(
        JSONB, server_default=text("'{}'::jsonb"), doc="Labels the operator set; they win over the agent's."
    )
    token_hash: Mapped[str] = mapped_column(String(64), index=True, doc="sha256 of the node credential.")
    agent_version: Mapped[str] = mapped_column(String(64), server_default="0")
    agent_instance: Mapped[str | None] = mapped_column(String(64))
    agent_epoch: Mapped[int] = mapped_column(
        BigInteger, server_default=text("0"), doc="Registrations so far; the credential of an older one is stale."
    )
    heartbeat_seq: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    memory_port: Mapped[int | None] = mapped_column(
        Integer, doc="TCP port of its agent's in-memory checkpoint tier at `address`; NULL: the tier is off there.")
    memory_tls: Mapped[bool] = mapped_column(
        Boolean, server_default=text("false"), doc="The memory port speaks TLS (https peer URLs); its agent has a "
        "node certificate signed by the cluster's CA.")
    last_heartbeat_at: Mapped[datetime | None] = _ts()
    heartbeat_interval_s: Mapped[float | None] = mapped_column(
        Float, doc="The heartbeat interval its agent was last told (it scales with the cluster); the monitor "
        "declares the node lost after this plus the configured slack. NULL: heartbeat_interval_s."
    )
    heartbeat_lag_s: Mapped[float | None] = mapped_column(
        Float, doc="How long its last heartbeat waited in the replica that took it, arrival to record (the "
        "liveness lane, control_plane/lanes.py); monitors extend the lost timeout by the largest recent one."
    )
    registered_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())

    gpus: Mapped[list[Gpu]] = relationship(back_populates="node", order_by="Gpu.index")

    @property
    def effective_labels(self) -> dict[str, str]:
        return {**(self.labels or {}), **(self.label_overrides or {})}

    def domain(self, topology_label: str) -> str:
        """The node's topology domain: its value of the topology label ('' without one; labels are
        at most 253 characters, the columns that hold a domain 255: a longer one stored before the
        limit is cut)."""
        return (self.effective_labels.get(topology_label) or "")[:255] if topology_label else ""


class Tenant(Base):
    """A team sharing the cluster. Jobs of a tenant without a row get weight 1 and no quota."""

    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("weight > 0", name="weight_positive"),
        CheckConstraint("gpu_quota IS NULL OR gpu_quota >= 0", name="quota_not_negative"),
    )

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    weight: Mapped[float] = mapped_column(
        Float, server_default=text("1"), doc="Share weight: GPUs in use / weight orders the queue."
    )
    gpu_quota: Mapped[int | None] = mapped_column(Integer, doc="Most GPUs its running jobs may hold.")
    max_priority: Mapped[int] = mapped_column(
        Integer, server_default=text("0"), doc="Highest priority its members may give a job (admins: any)."
    )
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())


class Gpu(Base):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index", name="uq_gpus_node_index"),)

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    uuid: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(128))
    memory_mb: Mapped[int] = mapped_column(Integer, server_default=text("0"))

    node: Mapped[Node] = relationship(back_populates="gpus")


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_state_created", "state", "created_at"),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
        Index("ix_jobs_principal_created", "principal", "created_at"),
        UniqueConstraint("principal", "idempotency_key", name="uq_jobs_principal_idempotency_key"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128))
    principal: Mapped[str] = mapped_column(String(128), doc="Who submitted it.")
    tenant: Mapped[str] = mapped_column(String(128), server_default="default")
    priority: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    state: Mapped[str] = mapped_column(String(16))
    num_nodes: Mapped[int] = mapped_column(Integer)
    gpus_per_node: Mapped[int] = mapped_column(Integer)
    gpu_kinds: Mapped[list[str] | None] = mapped_column(
        ARRAY(String(128)), doc="The GPU kinds the job accepts (a gang runs on one of them); NULL: any."
    )
    entrypoint: Mapped[str] = mapped_column(Text)
    args: Mapped[list[str]] = mapped_column(JSONB, server_default=text("'[]'::jsonb"))
    command: Mapped[list[str] | None] = mapped_column(
        JSONB, doc="The job's own command (argv), run once per node in place of torchrun (entrypoint is then ''); "
        "NULL: torchrun runs the entrypoint.")
    env: Mapped[dict[str, str]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    checkpoint: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    max_failures: Mapped[int] = mapped_column(Integer)
    failures: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    time_limit_s: Mapped[int | None] = mapped_column(Integer)
    model: Mapped[dict[str, Any] | None] = mapped_column(JSONB, doc="The model block it was submitted with.")
    layout: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="trainyard.protocol.layout.Layout its workers apply (TRAINYARD_LAYOUT); NULL: plain DDP.")
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSONB, doc="schemas/plans.py JobPlanOut, made at submit.")
    watchdog: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="schemas/jobs.py WatchdogSettings: the job's hang timeout and straggler overrides; NULL: defaults.")
    checkpoint_auto: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="The platform's checkpoint interval for interval_steps 'auto' (services/runs/intervals.py), "
        "with its inputs.")
    code: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="The shipped code (sha256, size_bytes: services/runs/code.py); NULL: the nodes' own.")
    python: Mapped[str | None] = mapped_column(Text, doc="Interpreter on the nodes for its workers; NULL: the agent's.")
    requirements: Mapped[str | None] = mapped_column(
        Text, doc="A pip requirements file each node installs into a cached venv for its workers; NULL: none.")
    restartable: Mapped[bool] = mapped_column(
        Boolean, server_default=text("false"),
        doc="Its workers restart in process: a healthy node's part is parked, then handed over to the next attempt.")
    retry_same_exception: Mapped[bool] = mapped_column(
        Boolean, server_default=text("false"),
        doc="Retry an exception raised again at the same step as in the attempt before (default: fail the job).")
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    memory_secret: Mapped[str | None] = mapped_column(
        String(64), doc="Authenticates its agents to each other for the in-memory checkpoint tier "
        "(services/checkpoints/memtier.py); set at its first allocation, never shown, never given to workers.")
    request_hash: Mapped[str | None] = mapped_column(String(64), doc="sha256 of the submit body.")
    current_attempt_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), ForeignKey("attempts.id", use_alter=True, ondelete="SET NULL")
    )
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    end_reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    updated_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    started_at: Mapped[datetime | None] = _ts()
    ended_at: Mapped[datetime | None] = _ts()

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node


class Attempt(Base):
    __tablename__ = "attempts"
    __table_args__ = (
        UniqueConstraint("job_id", "number", name="uq_attempts_job_number"),
        # A rendezvous port is the attempt's own on its host (node rank 0's address): torchrun's store
        # listens there. Other hosts may use the same number at once.
        Index(
            "uq_attempts_active_rdzv_port",
            "rdzv_host",
            "rdzv_port",
            unique=True,
            postgresql_where=text("state IN ('starting', 'running', 'stopping')"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer, doc="1, 2, ... per job: monotonic.")
    fencing_token: Mapped[str] = mapped_column(String(64), doc="Secret every message must carry.")
    state: Mapped[str] = mapped_column(String(16), doc="starting | running | stopping | ended")
    outcome: Mapped[str | None] = mapped_column(
        String(16), doc="succeeded | failed | cancelled once the attempt is over."
    )
    end_reason: Mapped[str | None] = mapped_column(Text)
    num_gpus: Mapped[int] = mapped_column(Integer, doc="Leases this attempt must hold: its gang size.")
    gpu_kind: Mapped[str | None] = mapped_column(String(128), doc="The GPU kind of its nodes (one per gang).")
    rdzv_host: Mapped[str] = mapped_column(String(255))
    rdzv_port: Mapped[int] = mapped_column(Integer)
    restored_from_step: Mapped[int | None] = mapped_column(Integer)
    restored_from_checkpoint_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), doc="The checkpoint this attempt restored (its lineage); None: from scratch."
    )
    hung_since: Mapped[datetime | None] = _ts(doc="Failed as hung: when its step last advanced.")
    checkpoint_interval_steps: Mapped[int | None] = mapped_column(
        Integer, doc="For a job with interval_steps 'auto': the interval its workers start with.")
    failure_kind: Mapped[str | None] = mapped_column(
        String(32), doc="Why a failed attempt failed, classified (trainyard.protocol.exits FAILURE_KINDS).")
    failed_node_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("nodes.id", ondelete="SET NULL"), doc="The node blamed for the failure, if one is."
    )
    restore_manifest: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    started_at: Mapped[datetime | None] = _ts(doc="When every worker was running.")
    failed_at: Mapped[datetime | None] = _ts()
    ended_at: Mapped[datetime | None] = _ts(doc="When every node confirmed its processes gone.")

    nodes: Mapped[list[AttemptPart]] = relationship(
        back_populates="attempt", order_by="AttemptPart.node_rank", foreign_keys="AttemptPart.attempt_id"
    )


class AttemptPart(Base):
    """One node's part of an attempt: what the agent must run and what it reported."""

    __tablename__ = "attempt_parts"
    __table_args__ = (
        UniqueConstraint("attempt_id", "node_rank", name="uq_attempt_parts_attempt_rank"),
        UniqueConstraint("attempt_id", "node_id", name="uq_attempt_parts_attempt_node"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"), index=True)
    node_rank: Mapped[int] = mapped_column(Integer)
    gpu_indices: Mapped[list[int]] = mapped_column(ARRAY(Integer))
    desired: Mapped[str] = mapped_column(String(8), doc="run | stop: what the agent must do.")
    state: Mapped[str] = mapped_column(
        String(16), doc="assigned | launching | running | parked | exited | stopped | gone"
    )
    adopts_attempt_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("attempts.id", ondelete="CASCADE"),
        doc="The earlier attempt whose parked part on this node (same GPUs) it took over; NULL: a cold start.")
    follows_part_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("attempt_parts.id", ondelete="SET NULL"),
        doc="The part of the job's previous attempt on this node whose GPU leases it was given while that part's "
        "processes were still stopping (services/runs/handover.py, pass_leases): it is not released before that "
        "part is, and its agent starts it once they are gone. NULL: its GPUs were free.")
    exit_code: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    error_kind: Mapped[str | None] = mapped_column(
        String(32), doc="The kind of `error` when its agent said it (start_error, launch_error); NULL: classified.")
    reported_at: Mapped[datetime | None] = _ts()
    released_at: Mapped[datetime | None] = _ts(doc="When its processes were confirmed gone.")
    spec_version: Mapped[str | None] = mapped_column(
        String(64), doc="Its launch spec's version, fixed at allocation (services/cluster/specs.py); NULL before 0014.")
    memory: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="Its in-memory checkpoint tier, fixed at allocation (services/checkpoints/memtier.py): "
        "peer_url (the agent keeping a copy of its shards) and sources (where the previous attempt's copies may "
        "be); NULL: off.")
    # Progress is kept per part, written by the node's own status reports (which never write the job
    # or the attempt row, so a job's nodes report at once); the views derive the attempt's and the
    # job's progress from it (services/runs/progress.py).
    progress_step: Mapped[int | None] = mapped_column(Integer, doc="Last step this node reported.")
    progress_loss: Mapped[float | None] = mapped_column(Float)
    progress_at: Mapped[datetime | None] = _ts(doc="When the workers reported that step (the node's clock).")
    progress_metrics: Mapped[dict[str, float] | None] = mapped_column(
        JSONB, doc="The metrics of that report (the measured compute/communication split, ...), finite values only."
    )
    first_progress_at: Mapped[datetime | None] = _ts(doc="When the first step of this node arrived.")
    received_at: Mapped[datetime | None] = _ts(
        doc="When its agent received the part (its report's age by the agent's monotonic clock, taken from the "
        "control plane's clock: a node's wall clock plays no part). NULL: not reported (an older agent).")
    initialized_at: Mapped[datetime | None] = _ts(
        doc="When every rank of the node had initialised its process group (as received_at: an age). NULL: not "
        "reported (a script without the runtime's init_distributed, or an older agent).")
    # The hang watchdog's clock, per part for the same reason (services/runs/watchdog.py takes the
    # attempt's latest advance over its parts).
    step_advanced_at: Mapped[datetime | None] = _ts(
        doc="When progress_step last grew (the control plane's clock).")
    step_time_s: Mapped[float | None] = mapped_column(
        Float, doc="Seconds per step, smoothed over the advances the control plane saw (the hang timeout's base).")
    ranks: Mapped[dict[str, Any] | None] = mapped_column(
        JSONB, doc="The latest RankSummary of its agent: each local rank's step, step time, busy time, silence.")
    ranks_at: Mapped[datetime | None] = _ts()
    straggler_rank: Mapped[int | None] = mapped_column(Integer, doc="Its rank slower than the job's peers now.")
    straggler_since: Mapped[datetime | None] = _ts(doc="Since when straggler_rank has been slower.")
    straggler_named_at: Mapped[datetime | None] = _ts(doc="When it was named a straggler (an event).")
    progress_total: Mapped[int | None] = mapped_column(Integer, doc="Total steps, when the script says.")
    progress_rate: Mapped[float | None] = mapped_column(
        Float, doc="Steps per second of this node's reports, smoothed over the recent ones.")
    progress_sampled_at: Mapped[datetime | None] = _ts(doc="Time of this node's last ProgressSample.")

    attempt: Mapped[Attempt] = relationship(back_populates="nodes", foreign_keys=[attempt_id])
    node: Mapped[Node] = relationship()
    workers: Mapped[list[Worker]] = relationship(
        back_populates="attempt_part", order_by="Worker.rank"
    )


class Worker(Base):
    __tablename__ = "workers"
    __table_args__ = (UniqueConstraint("attempt_id", "rank", name="uq_workers_attempt_rank"),)

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    attempt_part_id: Mapped[uuid.UUID] = mapped_column(
        ForeignKey("attempt_parts.id", ondelete="CASCADE"), index=True
    )
    rank: Mapped[int] = mapped_column(Integer)
    local_rank: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), doc="starting | running | exited")
    exit_code: Mapped[int | None] = mapped_column(Integer)
    exit_cause: Mapped[str | None] = mapped_column(String(32), doc="trainyard.protocol.exits kind of a failed exit.")
    exit_message: Mapped[str | None] = mapped_column(Text, doc="The worker's own words for it (its stderr).")
    started_at: Mapped[datetime | None] = _ts()
    ended_at: Mapped[datetime | None] = _ts()

    attempt_part: Mapped[AttemptPart] = relationship(back_populates="workers")


class GpuLease(Base):
    __tablename__ = "gpu_leases"
    __table_args__ = (
        Index(
            "uq_gpu_leases_active_gpu",
            "gpu_id",
            unique=True,
            postgresql_where=text("released_at IS NULL"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    gpu_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("gpus.id", ondelete="CASCADE"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id"), index=True)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    released_at: Mapped[datetime | None] = _ts()


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("job_id", "attempt_id", "step", name="uq_checkpoints_job_attempt_step"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    world_size: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(
        String(16), doc="pending | committed | unusable | aborted | deleted (services/states.py CHECKPOINT)"
    )
    objects_deleted: Mapped[bool] = mapped_column(Boolean, server_default=text("false"))
    manifest_key: Mapped[str | None] = mapped_column(Text)
    manifest_sha256: Mapped[str | None] = mapped_column(String(64), doc="Of the manifest object, at commit.")
    manifest_size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    manifest: Mapped[dict[str, Any] | None] = mapped_column(JSONB, doc="Published at commit.")
    size_bytes: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    shards_received: Mapped[int] = mapped_column(
        Integer, server_default=text("0"),
        doc="Shards recorded so far, counted after each report commits "
            "(services/checkpoints/checkpoints.py count_arrivals): tells a report its step is complete without "
            "counting the shards.",
    )
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    committed_at: Mapped[datetime | None] = _ts()
    reason: Mapped[str | None] = mapped_column(Text)
    blocking_s: Mapped[float | None] = mapped_column(
        Float, doc="The longest any rank's training loop was blocked by this save (reported with the shards).")
    background_s: Mapped[float | None] = mapped_column(
        Float, doc="The longest any rank's hashing, upload and report took, after the loop went on.")


class CheckpointShard(Base):
    __tablename__ = "checkpoint_shards"
    __table_args__ = (UniqueConstraint("checkpoint_id", "rank", name="uq_checkpoint_shards_ckpt_rank"),)

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    checkpoint_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("checkpoints.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    upload_wait_s: Mapped[float | None] = mapped_column(Float, doc="Time its rank waited for an upload slot.")
    upload_s: Mapped[float | None] = mapped_column(Float, doc="Time its upload took.")
    upload_slot: Mapped[str | None] = mapped_column(
        String(16), doc="granted | bypassed | none (trainyard/protocol/uploads.py SlotUse); NULL: not reported."
    )
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())


UPLOAD_SLOTS_OPEN_SQL = "state IN ('waiting', 'granted')"
"""The predicate of the open slots' unique index, as SQL text: an ON CONFLICT that names the index
must repeat it with constants, never bound parameters (a statement psycopg has prepared, from the
sixth run on a connection, then matches no index)."""


class UploadSlot(Base):
    """A checkpoint upload slot: one rank's lease on a share of the shared links for one shard
    (docs/architecture.md, "Checkpoint upload slots"; the pure policy is services/checkpoints/upload_policy.py).

    At most one open (waiting or granted) slot per (attempt, rank, step): asking again polls or
    renews it. ``seq`` orders the waiters (first come, first served). A slot counts against the
    limits while granted, unexpired and of its job's current attempt; anything else is reclaimed.
    """

    __tablename__ = "upload_slots"
    __table_args__ = (
        Index("uq_upload_slots_open", "attempt_id", "rank", "step", unique=True,
              postgresql_where=text(UPLOAD_SLOTS_OPEN_SQL)),
        Index("ix_upload_slots_waiting_seq", "seq", postgresql_where=text("state = 'waiting'")),
        Index("ix_upload_slots_granted_node", "node_id", postgresql_where=text("state = 'granted'")),
        Index("ix_upload_slots_job_id_seq", "job_id", "seq"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    seq: Mapped[int] = mapped_column(BigInteger, Identity(), doc="Arrival order: waiters are served oldest first.")
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("nodes.id", ondelete="CASCADE"))
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    label: Mapped[str] = mapped_column(
        String(255), doc="The node's topology domain when it asked (its TRAINYARD_TOPOLOGY_LABEL value; '' without)."
    )
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(
        String(16), doc="waiting | granted | released | expired (services/states.py UPLOAD_SLOT)"
    )
    requested_at: Mapped[datetime] = _ts(nullable=False)
    granted_at: Mapped[datetime | None] = _ts()
    expires_at: Mapped[datetime] = _ts(
        nullable=False, doc="Waiting: dropped unless asked again by then; granted: reclaimed unless renewed."
    )
    ended_at: Mapped[datetime | None] = _ts()
    rate_bytes_per_s: Mapped[int | None] = mapped_column(BigInteger, doc="The pace granted; NULL: unpaced.")
    ok: Mapped[bool | None] = mapped_column(Boolean, doc="Released: whether the upload succeeded.")
    uploaded_bytes: Mapped[int | None] = mapped_column(BigInteger)
    upload_s: Mapped[float | None] = mapped_column(Float)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), index=True
    )
    attempt_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    node_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True), index=True)
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())


class ProgressSample(Base):
    """A job's progress over time (the dashboard's loss and throughput chart): one row per
    ``progress_sample_s`` at most, written with the progress report that crossed it."""

    __tablename__ = "progress_samples"
    __table_args__ = (Index("ix_progress_samples_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_number: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    steps_per_s: Mapped[float | None] = mapped_column(Float)
    metrics: Mapped[dict[str, float]] = mapped_column(JSONB, server_default=text("'{}'::jsonb"))
    at: Mapped[datetime] = _ts(nullable=False)


class LogChunk(Base):
    __tablename__ = "log_chunks"
    __table_args__ = (
        UniqueConstraint(
            "attempt_id", "node_rank", "rank", "stream", "offset", name="uq_log_chunks_position"
        ),
        Index("ix_log_chunks_job_id_id", "job_id", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    node_rank: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    stream: Mapped[str] = mapped_column(String(8))
    offset: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())


class Reservation(Base):
    """GPUs the scheduler holds idle, and what that costs (docs/architecture.md, "Reservations").

    kind ``job``: a blocked job's reservation, one active row per job; ``recovery-reserve``: the
    spare nodes of one GPU kind kept for recovering jobs, one active row per kind. Each scheduling
    pass adds ``held_gpus`` x (now - ``updated_at``) to ``idle_gpu_seconds`` and writes the new
    ``held_gpus``; a row ends (``ended_at``) when its job starts or leaves the queue.
    """

    __tablename__ = "reservations"
    __table_args__ = (
        Index("uq_reservations_active_job", "job_id", unique=True,
              postgresql_where=text("ended_at IS NULL AND kind = 'job'")),
        Index("uq_reservations_active_reserve", "gpu_kind", unique=True,
              postgresql_where=text("ended_at IS NULL AND kind = 'recovery-reserve'")),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    seq: Mapped[int] = mapped_column(BigInteger, Identity(), doc="Order made: a pass makes many at one created_at.")
    kind: Mapped[str] = mapped_column(String(16), doc="job | recovery-reserve")
    job_id: Mapped[uuid.UUID | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    gpu_kind: Mapped[str | None] = mapped_column(String(128))
    node_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)), doc="The nodes held now.")
    earliest_start: Mapped[datetime | None] = _ts(doc="When the job fits there at the latest; None: unknown.")
    first_earliest_start: Mapped[datetime | None] = _ts(doc="The earliest start promised when it was made.")
    held_gpus: Mapped[int] = mapped_column(Integer, server_default=text("0"), doc="Idle GPUs held now.")
    idle_gpu_seconds: Mapped[float] = mapped_column(Float, server_default=text("0"), doc="Until updated_at.")
    served: Mapped[int] = mapped_column(Integer, server_default=text("0"), doc="Recoveries it ran (reserve).")
    created_at: Mapped[datetime] = _ts(nullable=False)
    updated_at: Mapped[datetime] = _ts(nullable=False)
    ended_at: Mapped[datetime | None] = _ts()
    end_reason: Mapped[str | None] = mapped_column(Text)


class PrincipalRecord(Base):
    """Someone (a person, a CI system) with a tenant and a role (control_plane/authz.py). Its API
    tokens are ``ApiToken`` rows; the bootstrap admin (TRAINYARD_ADMIN_TOKEN) has no row."""

    __tablename__ = "principals"
    __table_args__ = (
        CheckConstraint("role IN ('admin', 'operator', 'member', 'viewer')", name="role_known"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    tenant: Mapped[str] = mapped_column(String(128))
    role: Mapped[str] = mapped_column(String(16))
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    disabled_at: Mapped[datetime | None] = _ts(doc="Set: every token of it is refused.")


class ApiToken(Base):
    """A principal's bearer token, stored as its sha256 (the token itself is shown once, at creation)."""

    __tablename__ = "api_tokens"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    principal_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("principals.id", ondelete="CASCADE"), index=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, doc="sha256 hex of the token.")
    description: Mapped[str] = mapped_column(String(256), server_default="")
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    expires_at: Mapped[datetime | None] = _ts()
    last_used_at: Mapped[datetime | None] = _ts(doc="Updated at most once a minute.")
    revoked_at: Mapped[datetime | None] = _ts()
    parent_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="SET NULL"), index=True,
        doc="The token that created this one for its own principal: it never outlives it.")


class UiSession(Base):
    """A dashboard login (services/access/ui_sessions.py): the browser's cookie holds a random secret of
    its own, never an API token, stored here as its sha256; logging out revokes it."""

    __tablename__ = "ui_sessions"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True, doc="sha256 hex of the cookie's secret.")
    token_id: Mapped[uuid.UUID | None] = mapped_column(
        ForeignKey("api_tokens.id", ondelete="CASCADE"), index=True,
        doc="The API token the session was opened with; NULL: the bootstrap admin token.")
    admin_token_hash: Mapped[str | None] = mapped_column(
        String(64), doc="sha256 of the bootstrap admin token it was opened with (a changed token ends it).")
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    expires_at: Mapped[datetime] = _ts(nullable=False)
    revoked_at: Mapped[datetime | None] = _ts()


class JoinToken(Base):
    """A bootstrap token an agent registers with (services/access/join_tokens.py): it expires, and it is
    single-use unless created with more uses. One bound to a node name may also re-claim that
    registered node (an operator vouches for the machine)."""

    __tablename__ = "join_tokens"
    __table_args__ = (
        CheckConstraint("max_uses IS NULL OR max_uses >= 1", name="max_uses_positive"),
    )

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True, doc="sha256 hex of the token.")
    node_name: Mapped[str | None] = mapped_column(String(128), doc="Only this node name may register with it.")
    max_uses: Mapped[int | None] = mapped_column(Integer, doc="Registrations it allows; NULL: any until it expires.")
    uses: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    description: Mapped[str] = mapped_column(String(256), server_default="")
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = _ts(nullable=False, server_default=func.now())
    expires_at: Mapped[datetime] = _ts(nullable=False)
    last_used_at: Mapped[datetime | None] = _ts()
    revoked_at: Mapped[datetime | None] = _ts()


class StoragePutGrant(Base):
    """An object a worker was granted to create (services/checkpoints/storage_grants.py, issue 23 finding 7):
    one row per shard key, kept until the object is owned by a checkpoint (its shard was reported)
    or deleted by the storage sweep (services/checkpoints/storage_sweep.py) once its attempt has ended, so a
    granted object that was never reported does not stay in storage for ever."""

    __tablename__ = "storage_put_grants"
    __table_args__ = (Index("ix_storage_put_grants_attempt_step", "attempt_id", "step"),)

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True, default=new_id)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    attempt_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    key: Mapped[str] = mapped_column(Text, unique=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger, doc="The size the grant signed (Content-Length).")
    upload_id: Mapped[str | None] = mapped_column(
        Text, doc="Uploads in parts: the one upload id parts were granted for (aborted by the sweep).")
    granted_at: Mapped[datetime] = _ts(nullable=False)
