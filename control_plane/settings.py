"""One validated settings object for the control plane (environment prefix TRAINYARD_)."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from control_plane import failpoints
from trainyard.protocol.agent import AGENT_BACKOFF_S, agent_request_timeout_s
from trainyard.protocol.env import MAX_JOB_ENV_BYTES
from trainyard.protocol.s3tls import read_ca_pem, split_endpoint


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    database_url: str = Field(
        "postgresql+psycopg://postgres@localhost:5432/trainyard",
        description="SQLAlchemy URL of the PostgreSQL database (psycopg 3 driver).",
    )
    admin_token: str = Field(
        "", description="The bootstrap admin token, for first use: create principals and their tokens with it "
        "(POST /v1/principals), then keep it for emergencies. Empty: no bootstrap admin."
    )
    admin_tenant: str = Field("default", description="The tenant of the bootstrap admin's own jobs.")
    join_token: str = Field(
        "", description="Optional static join token: registers new node names only (never re-claims a registered "
        "node) and never expires. Empty (the default): agents register with per-node join tokens "
        "(POST /v1/join-tokens), which expire or are single-use."
    )

    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="How often agents heartbeat in a small cluster: the shortest interval given out."
    )
    node_lost_timeout_s: float = Field(
        10.0, gt=0, description="Missed-heartbeat time before a node is lost, at heartbeat_interval_s. A node "
        "told a longer interval gets the same slack on top of it (lost_timeout_for)."
    )
    heartbeat_target_rate_per_s: float = Field(
        40.0, gt=0, description="Heartbeats per second the whole cluster should send to the control plane: "
        "the interval agents are told grows with the number of nodes to keep to it (interval_for)."
    )
    heartbeat_interval_max_s: float = Field(
        30.0, gt=0, description="The longest interval agents are told, whatever the cluster's size. Long-poll "
        "wake-ups (POST /v1/agent/wait) bring new work and stop orders sooner."
    )
    agent_wait_timeout_s: float = Field(
        60.0, gt=0, le=120, description="The longest a long-poll wait (POST /v1/agent/wait) stays open without a "
        "change (agents ask for 25 s, or twice their interval): each wait costs a read when it starts."
    )
    agent_wait_max: int = Field(
        2000, ge=0, description="Long-poll waits one replica holds open at once; more are answered 503."
    )
    agent_wait_threads: int = Field(
        8, ge=1, le=256, description="Threads, apart from api_threads, that read a woken long poll's answer (its "
        "node's desired state): a node learns of its new attempt without waiting for a thread behind heartbeats "
        "and status reports (docs/architecture.md, \"Heartbeat interval and long-poll wake-ups\")."
    )
    startup_grace_s: float = Field(
        15.0, ge=0, description="After a control-plane start, no node is declared lost for this long."
    )
    scheduler_interval_s: float = Field(0.5, gt=0, description="Period of the scheduling loop.")
    monitor_interval_s: float = Field(1.0, gt=0, description="Period of the node-liveness loop.")
    checkpoint_maintenance_interval_s: float = Field(2.0, gt=0, description="Commit/abort/retention loop period.")
    checkpoint_pending_timeout_s: float = Field(
        600.0, gt=0, description="A checkpoint still missing shards after this long is aborted."
    )
    max_reservations: int = Field(
        4, ge=0, le=1000, description="Blocked jobs that hold a reservation at once (recovering jobs always do)."
    )
    topology_label: str = Field(
        "rack", description="Node label naming a topology domain; a gang is kept inside one if it can be. "
        "Empty: no topology preference."
    )
    recovery_reserve_nodes: int | dict[str, int] = Field(
        0, description='Nodes kept for recovering jobs only: a number for every GPU kind, or JSON such as '
        '{"h100": 2} per kind.'
    )
    recovery_pass_leases: bool = Field(
        True, description="A failed attempt's GPUs on healthy nodes pass straight to its job's next attempt while "
        "their processes stop (each node's agent starts its new part once they are gone), so a recovery does not "
        "wait for every node's release; false: the next attempt is placed only once its GPUs are released."
    )
    plan_min_efficiency: float = Field(
        0.7, ge=0, le=1, description="Scaling efficiency (tokens/s per GPU against the smallest GPU count that "
        "runs) below which a job's GPU count is warned about at submit, and the least a plan's recommendation "
        "keeps (docs/planner.md)."
    )
    upload_slots_max: int = Field(
        0, ge=0, description="Checkpoint shard uploads in flight at once in the whole cluster; 0: unlimited "
        "(docs/architecture.md, \"Checkpoint upload slots\")."
    )
    upload_slots_per_label: int = Field(
        0, ge=0, description="Checkpoint shard uploads in flight at once per topology domain (nodes with one "
        "value of topology_label; nodes without the label form one domain); 0: unlimited."
    )
    upload_node_rate_bytes_per_s: int = Field(
        0, ge=0, description="Bytes per second the checkpoint uploads of one node may use together, shared "
        "evenly by its uploads in flight; 0: unlimited."
    )
    upload_slot_ttl_s: float = Field(
        30.0, gt=0, le=3600, description="An upload slot's lease: a granted slot not renewed (its worker renews "
        "every third of it) or a queue place not asked for again within this long is reclaimed."
    )
    upload_slot_poll_s: float = Field(
        20.0, gt=0, le=60, description="The longest one long poll for an upload slot stays open."
    )
    upload_slot_max_wait_s: float = Field(
        900.0, ge=0, description="A worker waits this long for an upload slot at most, then uploads without one "
        "(with a checkpoint.upload_unslotted event); 0: no bound but the next save."
    )
    upload_slot_wait_max: int = Field(
        4000, ge=0, description="Upload-slot long polls one replica holds open at once; more are answered 503."
    )
    limits_interval_s: float = Field(1.0, gt=0, description="Period of the time-limit loop.")
    attempt_launch_timeout_s: float = Field(
        60.0, gt=0, description="A node's part of an attempt that its agent has not confirmed launching this "
        "long after allocation fails the attempt. Longer than node_lost_timeout_s: a silent node is "
        "declared lost first (the clearer reason); this catches a live agent that never picks the part up."
    )
    watchdog_interval_s: float = Field(
        5.0, gt=0, description="Period of the watchdog loop: hung attempts, stragglers, the auto checkpoint interval.")
    hang_timeout_min_s: float = Field(
        120.0, gt=0, description="The floor of the hang timeout: a running attempt whose step has not advanced for "
        "max(this, hang_step_multiplier x its step time + its longest checkpoint stall) is failed as hung (a "
        "job's watchdog.hang_timeout_s overrides it).")
    startup_timeout_s: float = Field(
        900.0, gt=0, le=7 * 86400, description="A running attempt (every worker started) none of whose ranks has "
        "reported a first step this long after it started is failed as not starting, with the last stderr lines "
        "of each rank in the reason (issue 24: a job whose DataLoader workers failed sat in running forever). "
        "Covers imports, rendezvous, the restore and the first step (a torch.compile too).")
    hang_step_multiplier: float = Field(
        10.0, ge=1, description="Step times a step may take before the attempt counts as hung (above the floor).")
    straggler_factor: float = Field(
        1.5, gt=1, description="A rank whose busy time per step exceeds this many times its peers' median is slow "
        "(a job's watchdog.straggler_factor overrides it).")
    straggler_persist_s: float = Field(
        60.0, gt=0, description="How long a rank must stay slow before it is named a straggler (an event, the "
        "job view).")
    recovery_budget_detection_s: float | None = Field(
        15.0, gt=0, description="Recovery budget: failure -> the attempt failed (a worker's exit is seen within "
        "a report; a lost node within node_lost_timeout_s). A recovery over any of its phases' budgets writes a "
        "recovery.over_budget event (docs/operations.md). Empty: no budget.")
    recovery_budget_decision_s: float | None = Field(
        5.0, gt=0, description="Recovery budget: failed -> the new attempt created (the peers stop, the gang is "
        "placed again).")
    recovery_budget_wake_up_s: float | None = Field(
        1.0, gt=0, description="Recovery budget: created -> every node's agent has its part (long poll).")
    recovery_budget_process_start_s: float | None = Field(
        30.0, gt=0, description="Recovery budget: received -> every worker process running (torchrun's start, a "
        "job's requirements).")
    recovery_budget_rendezvous_s: float | None = Field(
        60.0, gt=0, description="Recovery budget: running -> every rank's process group initialised (the "
        "script's imports and torch.distributed's rendezvous).")
    recovery_budget_restore_s: float | None = Field(
        120.0, gt=0, description="Recovery budget: initialised -> the first step (the checkpoint read back, one "
        "step).")
    failure_prior_node_mtbf_h: float = Field(
        5000.0, gt=0, description="Mean time between failures of one node assumed until the cluster has history "
        "(node-hours per failure; the auto checkpoint interval's MTBF).")
    failure_prior_weight_node_h: float = Field(
        2000.0, ge=0, description="How many node-hours of history the prior counts as: the observed rate takes over "
        "as the cluster's node-hours grow past it.")
    checkpoint_auto_min_s: float = Field(
        30.0, gt=0, description="The shortest interval the auto rule sets (seconds of training).")
    checkpoint_auto_cost_prior_s: float = Field(
        10.0, gt=0, description="Checkpoint blocking cost assumed until a job's first save is measured.")
    metrics_token: str = Field(
        "", description="Bearer token GET /metrics requires; empty: /metrics is open (it carries no job names, "
        "tenants or ids, only cluster totals).")
    metrics_cache_s: float = Field(
        5.0, ge=0, description="How long /metrics reuses the figures it read from the database.")
    rdzv_port_min: int = Field(20000, ge=1024, le=65535, description=(
        "Lowest rendezvous port; an attempt's port is its own on node rank 0's host."))
    rdzv_port_max: int = Field(32767, ge=1024, le=65535, description=(
        "Highest rendezvous port. Keep the range below the nodes' ephemeral ports (Linux: "
        "net.ipv4.ip_local_port_range, 32768-60999 by default): an outgoing connection's local port "
        "taken from the range makes torchrun's store fail with EADDRINUSE."))
    max_env_bytes: int = Field(
        MAX_JOB_ENV_BYTES, gt=0, le=MAX_JOB_ENV_BYTES,
        description="Largest total size of a job's env (NAME=value and a NUL each); submit refuses more with 422.",
    )
    log_follow_poll_s: float = Field(0.5, gt=0, description="How often a followed log is read again.")
    log_followers_per_principal: int = Field(
        4, ge=1, le=1000, description="Logs one principal may follow at once on one replica; more are answered 429."
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=64 * 1024, description="Largest request body; larger ones are answered 413."
    )
    max_code_bytes: int = Field(
        256 * 1024 * 1024, ge=1024 * 1024, description="Largest code archive (trainyard run's workdir, packed); "
        "larger ones are answered 413."
    )
    submit_rate_per_window: int = Field(
        60, ge=1, description="Jobs one principal (admins excepted) may submit per submit_rate_window_s; more are "
        "answered 429 with Retry-After. Counted in the database: the limit holds across replicas."
    )
    submit_rate_window_s: float = Field(60.0, gt=0, le=86400)
    log_retention_days: float = Field(
        30.0, ge=0, description="Worker log lines older than this are deleted (0: kept forever)."
    )
    event_retention_days: float = Field(
        90.0, ge=0, description="Events older than this are deleted (0: kept forever)."
    )
    retention_interval_s: float = Field(60.0, gt=0, description="Period of the retention loop.")
    retention_batch: int = Field(5000, ge=1, le=1_000_000, description="Rows one retention statement deletes.")

    api_threads: int = Field(
        40, ge=1, le=1000, description="Threads that run requests; the connection pool is sized to cover them."
    )
    bookkeeping_gate: bool = Field(
        True, description="Hold agents' checkpoint and progress reports at the liveness lane's gate "
        "(bookkeeping_concurrency in flight, one beside liveness; docs/architecture.md). False: counted, "
        "never held (heartbeats are still stamped at arrival and the lost guard holds)."
    )
    bookkeeping_concurrency: int = Field(
        4, ge=1, le=64, description="Checkpoint and progress reports from agents (shards, events, logs, storage "
        "grants, slot releases) one replica runs at once; one at a time while a heartbeat, registration or status "
        "report is in flight: the liveness lane (docs/architecture.md). Less than api_threads."
    )
    bookkeeping_queue_max: int = Field(
        1024, ge=0, le=1_000_000, description="Such reports one replica lets wait for the gate (no thread, no "
        "connection); more are answered 503 with Retry-After and agents resend."
    )
    bookkeeping_wait_s: float = Field(
        5.0, gt=0, description="Longest a report waits for the gate before it is answered 503 with Retry-After "
        "(below the agents' 10 s request timeout, so the agent hears the answer)."
    )
    db_pool_timeout_s: float = Field(
        2.0, gt=0, description="How long a request waits for a database connection before it is answered 503 "
        "(at most half the agents' request timeout, which is derived from the heartbeat settings)."
    )

    s3_endpoint: str = Field("", description="host:port of the S3 server for checkpoints.")
    s3_access_key: str = Field("", description="The control plane's S3 key; workers and agents never get it.")
    s3_secret_key: str = ""
    s3_bucket: str = "trainyard"
    s3_secure: bool = Field(False, description="Speak HTTPS to S3 (also said by an https:// s3_endpoint).")
    s3_ca_file: str = Field(
        "", description="PEM file of the CA(s) that sign S3's certificate, when not the system's trust store: the "
        "control plane verifies S3 with it and agents give it to workers (a CA, no credential)."
    )
    s3_region: str = "us-east-1"
    s3_worker_endpoint: str = Field(
        "", description="host:port at which workers reach S3, when it is not s3_endpoint (presigned URLs name "
        "it, and their signature covers the host). Empty: s3_endpoint."
    )
    storage_grant_ttl_s: int = Field(
        300, ge=10, le=3600, description="How long a presigned checkpoint URL stays valid (S3 checks it when a "
        "request starts, so an upload that started in time finishes). Workers ask again when one runs out."
    )
    storage_part_size_mb: int = Field(
        512, ge=5, le=5120, description="Checkpoint objects up to this size are uploaded with one PUT; larger "
        "ones in parts of this size (S3: one PUT up to 5 GiB, parts of 5 MiB to 5 GiB, at most 10,000)."
    )
    # Storage bounds (issue 23, findings 7 and 8; docs/security.md, "Storage bounds").
    storage_max_shard_gb: float = Field(
        256.0, gt=0, le=5 * 1024, description="Largest checkpoint shard any worker is granted to write (its "
        "Content-Length is signed: S3 refuses a larger body); larger requests are answered 422."
    )
    storage_shard_growth: float = Field(
        8.0, ge=0, description="Once a job has a committed checkpoint, a shard is granted at most this many times "
        "its largest committed shard (at least storage_shard_floor_mb; 8 covers optimizer state that appears "
        "after a first save of bf16 weights); 0: only storage_max_shard_gb."
    )
    storage_shard_floor_mb: int = Field(64, ge=1, description="The least the observed bound grants a shard.")
    storage_open_saves: int = Field(
        16, ge=1, le=100, description="Steps of one attempt whose shards may be granted while none of them is "
        "decided (committed or aborted); a grant for one more is answered 409. Saves go on while commits "
        "wait (a database restart): 4 aborted the last save of a job that saved every 2 s across one."
    )
    storage_step_lead: int = Field(
        1_000_000, ge=1, description="How far beyond the attempt's last known step (reported progress, restored "
        "step, checkpoints) a shard's step may be; further ones are answered 403."
    )
    code_quota_archives: int = Field(
        200, ge=1, description="Code archives one tenant may keep; an upload past it is answered 409 (code-quota)."
    )
    code_quota_gb: float = Field(
        20.0, gt=0, description="Bytes of code archives one tenant may keep, in GiB; an upload past it is answered "
        "413 (code-quota)."
    )
    code_unreferenced_days: float = Field(
        7.0, ge=0, description="A code archive no unfinished job names, uploaded and last used by a job longer "
        "ago than this, is deleted (0: kept forever)."
    )
    code_uploads_per_principal: int = Field(
        2, ge=1, le=100, description="Code uploads one principal may have in flight on one replica; more are "
        "answered 429 with Retry-After."
    )

    failpoints: str = Field(
        "", description="Testing only: 'name=sleep(S)' or 'name=exit' pairs, ';'-separated (failpoints.py)."
    )

    run_loops: bool = Field(
        True, description="Run the scheduler and monitor loops in this process (and a pass when GPUs are freed)."
    )
    log_json: bool = True
    log_level: str = "INFO"

    # HTTP connections: every request gets an answer (issue 28; control_plane/http_deadlines.py).
    http_keep_alive_s: float = Field(
        75.0, ge=1, le=3600, description="Seconds the server keeps an idle connection open; longer than its "
        "clients keep one (the agents 5 s) and than a load balancer in front does (commonly 60 s), or a "
        "request sent as the server closes the connection gets no answer.")
    request_body_idle_s: float = Field(
        30.0, gt=0, le=3600, description="A request body that stops arriving for this long is answered 408 "
        "(uvicorn itself would wait for ever).")

    @property
    def agent_request_timeout_s(self) -> float:
        """What agents registered here use as their per-try request timeout (trainyard/protocol/agent.py)."""

        return agent_request_timeout_s(self.heartbeat_interval_s, self.node_lost_timeout_s)

    @property
    def recovery_budgets(self) -> dict[str, float | None]:
        """Phase -> the cluster's budget in seconds (services/runs/recovery_budget.py PHASES)."""
        prefix = "recovery_budget_"
        return {name[len(prefix):-2]: getattr(self, name) for name in type(self).model_fields
                if name.startswith(prefix)}

    def interval_for(self, nodes: int) -> float:
        """The heartbeat interval agents are told in a cluster of ``nodes`` registered nodes: their
        heartbeats together come at about ``heartbeat_target_rate_per_s``, within
        [heartbeat_interval_s, heartbeat_interval_max_s]."""
        wanted = max(0, nodes) / self.heartbeat_target_rate_per_s
        return round(min(self.heartbeat_interval_max_s, max(self.heartbeat_interval_s, wanted)), 3)

    def lost_timeout_for(self, interval_s: float) -> float:
        """The node-lost timeout of a node told ``interval_s``: the configured slack
        (node_lost_timeout_s - heartbeat_interval_s) on top of its interval. The slack, and so the
        agents' per-try request timeout (agent_request_timeout_s), is the same at every interval, so
        the nesting checked at start holds for every interval given out."""
        return max(interval_s, self.heartbeat_interval_s) + self.node_lost_timeout_s - self.heartbeat_interval_s

    @property
    def node_lost_timeout_max_s(self) -> float:
        """The longest node-lost timeout any node can get (at heartbeat_interval_max_s)."""
        return self.lost_timeout_for(self.heartbeat_interval_max_s)

    @property
    def pool_timeout_s(self) -> float:
        """The pool wait actually used: a request must be answered (503) before its agent gives up."""
        return min(self.db_pool_timeout_s, self.agent_request_timeout_s / 2)

    def _check_s3(self) -> None:
        """An https:// (or http://) endpoint sets s3_secure; a CA file must load (s3tls.read_ca_pem)."""

        for name in ("s3_endpoint", "s3_worker_endpoint"):
            endpoint, secure = split_endpoint(getattr(self, name))
            if secure is not None and name == "s3_endpoint":
                self.s3_secure = secure
            elif secure is not None and secure != self.s3_secure:
                raise ValueError("s3_worker_endpoint's scheme must agree with s3_endpoint's")
            setattr(self, name, endpoint)
        if self.s3_ca_file:
            if not self.s3_secure:
                raise ValueError("s3_ca_file needs S3 over HTTPS (an https:// s3_endpoint or s3_secure=true)")
            read_ca_pem(self.s3_ca_file)

    def _check_timeouts(self) -> None:
        """Each timeout fits inside the next (docs/architecture.md, "Time and timeouts")."""

        if self.heartbeat_interval_s + AGENT_BACKOFF_S >= self.node_lost_timeout_s:
            raise ValueError(
                f"node_lost_timeout_s ({self.node_lost_timeout_s:g}) must exceed heartbeat_interval_s "
                f"({self.heartbeat_interval_s:g}) plus the agents' retry backoff ({AGENT_BACKOFF_S:g}s): a "
                "heartbeat and its retries must arrive before the node is declared lost"
            )
        if self.heartbeat_interval_max_s < self.heartbeat_interval_s:
            raise ValueError("heartbeat_interval_max_s must not be shorter than heartbeat_interval_s")
        if self.monitor_interval_s >= self.node_lost_timeout_s:
            raise ValueError("monitor_interval_s must be shorter than node_lost_timeout_s")
        # The longest lost timeout a scaled interval gives (lost_timeout_for) must nest too.
        lost_max = self.node_lost_timeout_max_s
        if self.checkpoint_pending_timeout_s <= lost_max + self.checkpoint_maintenance_interval_s:
            raise ValueError(
                f"checkpoint_pending_timeout_s must exceed the longest node-lost timeout ({lost_max:g}s, at "
                "heartbeat_interval_max_s) plus checkpoint_maintenance_interval_s: shards of a node whose "
                "reports are retried must be awaited"
            )
        if self.attempt_launch_timeout_s <= lost_max:
            raise ValueError(
                f"attempt_launch_timeout_s must exceed the longest node-lost timeout ({lost_max:g}s, at "
                "heartbeat_interval_max_s): a silent node is declared lost first"
            )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        self._check_timeouts()
        self._check_s3()
        if self.bookkeeping_concurrency >= self.api_threads:
            raise ValueError("bookkeeping_concurrency must be less than api_threads: liveness keeps the rest")
        if self.rdzv_port_min > self.rdzv_port_max:
            raise ValueError("rdzv_port_min must not exceed rdzv_port_max")

        failpoints.configure(self.failpoints)
        reserve = self.recovery_reserve_nodes
        sizes = reserve.values() if isinstance(reserve, dict) else [reserve]
        if any(n < 0 for n in sizes):
            raise ValueError("recovery_reserve_nodes must be >= 0")
        return self


@lru_cache
def get_settings() -> Settings:
    return Settings()
