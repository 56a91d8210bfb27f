"""The node agent's runtime configuration (re-exported by node_agent.agent)."""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from node_agent.confinement.isolation import UidRange
from node_agent.confinement.limits import LimitOptions
from node_agent.link import credential
from node_agent.link.batcher import WINDOW_S
from node_agent.link.outbox import MAX_BYTES_PER_NODE, MAX_ITEMS_PER_NODE
from node_agent.part.code import CodeLimits
from trainyard.protocol.memtier import DEFAULT_BUDGET_MB

MAX_STANDBYS = 64


def default_run_dir() -> Path:
    """Machine-local runtime state shared by every agent of the machine (sockets, uid locks):
    /run/trainyard for root, else a directory of this user's under the temporary directory."""
    if os.geteuid() == 0:
        return Path("/run/trainyard")
    return Path(tempfile.gettempdir()) / f"trainyard-{os.geteuid()}"


def read_join_token(path: Path | None) -> str:
    """The join token from ``path`` (its first line) or else TRAINYARD_JOIN_TOKEN; "" if neither."""
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the join token file {path}: {exc.strerror or exc}") from exc
    return os.environ.get("TRAINYARD_JOIN_TOKEN", "").strip()


@dataclass(kw_only=True)
class AgentConfig:
    control_plane_url: str
    """Base URL of the control plane, e.g. https://10.0.0.1:8000."""
    ca_file: Path | None = None
    """PEM file of the CA(s) whose certificates this agent trusts for the control plane; None: the
    system's trust store."""
    join_token: str = ""
    """A join token (an operator's ``trainyard join-tokens create``) for the first registration; later
    registrations use the node credential kept in work_dir (node_agent/link/credential.py). Read from a
    file or TRAINYARD_JOIN_TOKEN (read_join_token), never from the command line."""
    name: str
    """Node name, unique in the cluster; re-registering a name keeps its node id."""
    address: str
    """Address other nodes reach this node at: rendezvous host when this node is an attempt's node
    rank 0, and torchrun's --local-addr. (The workers' local API is a unix socket per attempt.)"""
    virtual_gpus: int | None = None
    """Offer this many CPU-only virtual slots; None: discover NVIDIA GPUs through NVML."""
    work_dir: Path = field(default_factory=lambda: Path(".trainyard/agent"))
    """The agent's state: one private directory per attempt (state, torchrun's logs). Reuse it
    across restarts of the same node: that is how a restarted agent finds the attempts still running
    and never relaunches one."""
    worker_uids: UidRange | None = None
    """Pool of uids (and gids of the same numbers) to run attempts as, one per attempt part
    (node_agent/confinement/isolation.py). Needs root. None: workers run as the agent's own user (logged loudly:
    they are then not isolated from the agent or from each other)."""
    worker_root: Path | None = None
    """Where each attempt part's worker directory (its cwd, HOME, TMPDIR, logs) is made; every
    directory above it must let other users through (o+x) when worker_uids is set. None:
    work_dir/workers."""
    run_dir: Path | None = None
    """Machine-local runtime directory shared by the machine's agents: the local API's sockets and
    the worker uid locks. None: default_run_dir()."""
    cgroups: bool = True
    """Track each attempt part's processes in a cgroup v2 of its own where the hierarchy is
    writable (else by uid, or by markers)."""
    standbys: int | None = 0
    """Warm standby processes to keep (node_agent/ranks/standby.py): interpreters with torch imported, no
    job state, no CUDA context, each of which a new attempt's torchrun or rank may become instead of
    starting cold. None (``auto``, the command line's default): one per GPU plus one for torchrun
    where workers are tracked by cgroup or uid, else none. 0: off (this class's default, for
    agents built in code). A number needs workers tracked by cgroup or uid."""
    worker_env_passthrough: tuple[str, ...] = ()
    """Variables of the agent's environment to give workers besides the built-in allow-list
    (node_agent/part/commands.py, PASSTHROUGH_ENV)."""
    labels: dict[str, str] = field(default_factory=dict)
    """Topology labels sent at registration, e.g. {"rack": "r1"}."""
    stop_grace_s: float = 5.0
    """Time between SIGTERM and SIGKILL when stopping an attempt's processes."""
    handover_timeout_s: float = 60.0
    """How long a restartable part told to stop keeps its workers parked, waiting for the next
    attempt to take them over, before it stops them as usual (the next attempt then starts cold)."""
    keep_workers_on_exit: bool = False
    """On shutdown, leave the workers running (a restarted agent re-adopts them) instead of
    stopping them."""
    status_interval_s: float = 3.0
    """An attempt's status is sent when it changes and at least this often while alive."""
    poll_interval_s: float = 0.25
    """How often local processes, rank files and log files are looked at."""
    rdzv_join_timeout_s: int = 300
    """How long torchrun waits for the other nodes of an attempt to join its rendezvous."""
    http_timeout_s: float = 10.0
    """Timeout of one control-plane request."""
    min_free_mb: int = 64
    """An attempt is not started when its work dir's file system has less free space than this: its
    logs, rank status files and state could not be written, and it would fail later with a reason
    nobody can read. It fails at once instead, saying the disk is full."""
    pip_constraints: Path | None = None
    """A pip constraints file applied to every job's requirements (node_agent/part/envs.py); the node's
    own torch is always pinned besides."""
    env_cache_max_count: int = 8
    """Venvs of jobs' requirements kept in work_dir/envs; past this (or env_cache_max_gb), the least
    recently used that no attempt holds are removed."""
    env_cache_max_gb: float = 20.0
    """Disk the cached venvs may take, in GiB (see env_cache_max_count)."""
    env_build_timeout_s: float = 1800.0
    """A job's requirements that take longer to install fail its attempt (start_error)."""
    code_max_bytes: int = CodeLimits.max_bytes
    """A job's shipped code: its archive's download, and its unpacked files together, each at most
    this (node_agent/part/code.py); over it the job fails (start_error)."""
    code_max_entries: int = CodeLimits.max_entries
    """A job's shipped code: files, directories and links in its archive, at most."""
    code_timeout_s: float = CodeLimits.timeout_s
    """A job's shipped code: its download, then its unpacking, each at most this long."""
    allowed_pythons: tuple[Path, ...] = ()
    """Interpreters a job may name as its ``python`` besides the agent's own and those root owns with
    no directory above them writable by anyone else (node_agent/confinement/interpreters.py). A job naming any
    other fails at once (start_error), never retried."""

    outbox_max_items: int = MAX_ITEMS_PER_NODE
    """The most shards and events the agent holds for the control plane, over every attempt of the
    node (each attempt has a budget of its own as well: node_agent/link/outbox.py). Past it the attempt
    holding the most loses its oldest events, then shards, and an event says so."""
    outbox_max_bytes: int = MAX_BYTES_PER_NODE
    """The same budget in bytes (of the items' JSON)."""
    batch_window_s: float = WINDOW_S
    """How long the workers' upload-slot and storage requests are gathered, after the first, into one
    request to the control plane (node_agent/link/batcher.py); a batch holding a request of every
    local rank goes at once. 0: only requests that arrive together are batched."""

    memory_tier_mb: int = DEFAULT_BUDGET_MB
    """Host memory (MiB) for checkpoint shards of the in-memory tier (node_agent/memtier/tier.py): the
    latest two shards of each local rank and the copies peers push here, oldest evicted first. 0: the
    tier is off on this node (no memory port is registered; workers hand nothing over)."""
    memory_port: int = 0
    """TCP port of the memory tier at ``address`` for peer agents; 0: any free port (registered)."""
    memory_tls_cert: Path | None = None
    """PEM certificate (chain) of this node, for ``address``, signed by the cluster's CA: the memory
    port then speaks TLS only, and this agent reaches its peers over TLS only (verifying them against
    ``ca_file``). None: no memory port at all, unless ``memory_plain_http``."""
    memory_tls_key: Path | None = None
    """PEM private key of memory_tls_cert."""
    memory_plain_http: bool = False
    """Serve the memory port in plain HTTP when there is no memory_tls_cert (a trusted network only:
    the jobs' grants and shards cross it in clear; logged as a warning at start). False: a node
    without a certificate keeps the tier off (logged), so shards never travel in clear by default."""

    @property
    def code_limits(self) -> CodeLimits:
        return CodeLimits(max_bytes=self.code_max_bytes, max_entries=self.code_max_entries,
                          timeout_s=self.code_timeout_s)
    limits: LimitOptions = field(default_factory=LimitOptions)
    """Each attempt part's resource limits (node_agent/confinement/limits.py): derived from its share of the
    node's GPUs unless set here (``--part-memory-limit`` etc.); ``enabled=False``: none."""

    def __post_init__(self) -> None:
        self.work_dir = Path(self.work_dir).absolute()
        if self.ca_file is not None:
            self.ca_file = Path(self.ca_file)
            if not self.ca_file.is_file():
                raise ValueError(f"ca_file {self.ca_file} is not a readable file")
        if not self.control_plane_url.startswith(("http://", "https://")):
            raise ValueError(f"control_plane_url must be an http(s) URL, got {self.control_plane_url!r}")
        if not self.join_token and credential.load(self.work_dir) is None:
            raise ValueError("no join token: pass --join-token-file or set TRAINYARD_JOIN_TOKEN (the agent needs one "
                             "until it has registered and keeps its node credential in its work dir)")
        if not self.name or len(self.name) > 128:
            raise ValueError("name must be 1-128 characters")
        if not self.address:
            raise ValueError("address is required")
        if self.virtual_gpus is not None and self.virtual_gpus < 0:
            raise ValueError("virtual_gpus must be >= 0 (or None for NVIDIA discovery)")
        if any(name.startswith("TRAINYARD_") for name in self.worker_env_passthrough):
            raise ValueError("the agent's TRAINYARD_* variables are never passed to workers")
        for name in ("stop_grace_s", "status_interval_s", "poll_interval_s", "http_timeout_s", "handover_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.env_cache_max_count < 1 or self.env_cache_max_gb <= 0 or self.env_build_timeout_s <= 0:
            raise ValueError("env_cache_max_count must be >= 1, env_cache_max_gb and env_build_timeout_s > 0")
        if self.code_max_bytes < 1 or self.code_max_entries < 1 or self.code_timeout_s <= 0:
            raise ValueError("code_max_bytes, code_max_entries and code_timeout_s must be > 0")
        self.allowed_pythons = tuple(Path(p) for p in self.allowed_pythons)
        for python in self.allowed_pythons:
            if not python.is_absolute() or not python.is_file() or not os.access(python, os.X_OK):
                raise ValueError(f"allowed python {python} is not an absolute path to an executable file")
        if self.pip_constraints is not None and not Path(self.pip_constraints).is_file():
            raise ValueError(f"pip_constraints {self.pip_constraints} is not a readable file")
        if self.outbox_max_items < 2 or self.outbox_max_bytes < 1:
            raise ValueError("outbox_max_items must be >= 2 and outbox_max_bytes >= 1")
        if not 0 <= self.batch_window_s <= 1:
            raise ValueError("batch_window_s must be 0..1")
        if self.standbys is not None and not 0 <= self.standbys <= MAX_STANDBYS:
            raise ValueError(f"standbys must be 0..{MAX_STANDBYS}")
        if self.memory_tier_mb < 0 or not 0 <= self.memory_port <= 65535:
            raise ValueError("memory_tier_mb must be >= 0 and memory_port a port number (0: any)")
        if (self.memory_tls_cert is None) != (self.memory_tls_key is None):
            raise ValueError("memory_tls_cert and memory_tls_key go together")
        if self.memory_tls_cert is not None and self.ca_file is None:
            # Peers' node certificates are signed by the cluster's CA: against the system's trust
            # store every transfer to a peer would fail, and the tier would miss without a word.
            raise ValueError("memory_tls_cert needs ca_file (the cluster CA that signs the peers' node certificates)")
        if self.memory_tls_cert is not None:
            self.memory_tls_cert, self.memory_tls_key = Path(self.memory_tls_cert), Path(self.memory_tls_key or "")
            self.memory_tls_context()  # a certificate that cannot be used is refused at start
        if self.rdzv_join_timeout_s <= 0:
            raise ValueError("rdzv_join_timeout_s must be > 0")

    def memory_tls_context(self) -> ssl.SSLContext | None:
        """The memory port's server context (memory_tls_cert); None: plain HTTP. Raises ValueError."""
        if self.memory_tls_cert is None or self.memory_tls_key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(self.memory_tls_cert, self.memory_tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot use the memory TLS certificate {self.memory_tls_cert} with key "
                             f"{self.memory_tls_key}: {getattr(exc, 'strerror', None) or exc}") from exc
        return context

    def peer_client_context(self) -> ssl.SSLContext:
        """What peers' memory ports are verified against: ca_file (the cluster's CA), else the system's."""
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file is not None else None)

    @property
    def workers_dir(self) -> Path:
        """worker_root, or its default."""
        return Path(self.worker_root).absolute() if self.worker_root else self.work_dir / "workers"

    @property
    def runtime_dir(self) -> Path:
        """run_dir, or its default."""
        return Path(self.run_dir).absolute() if self.run_dir else default_run_dir()
