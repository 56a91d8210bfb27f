"""The configuration of ``trainyard dev up`` (DevConfig, checked as it is made) and the names its
parts share: the errors, the ready marker, the worker uid pool."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.dev.netns import Topology
from trainyard.protocol.s3tls import read_ca_pem, split_endpoint

READY_MARKER = "TRAINYARD_READY"
DEV_WORKER_UIDS = "20000-20255"
"""Shared by every dev cluster of the machine: agents lease uids under locks, never one in use."""


NOT_ISOLATED = "WORKERS NOT ISOLATED"
"""Starts the line ``dev up`` prints when its default uid pool cannot be used here."""


class DevError(RuntimeError):
    """``dev up`` could not start (the message says what to do about it)."""


class _Interrupted(Exception):
    """A stop was requested (signal) while starting."""


@dataclass(kw_only=True)
class DevConfig:
    nodes: int = 2
    """Number of node agents."""
    gpus_per_node: int = 2
    """Virtual (CPU-only) GPU slots each agent offers."""
    port: int = 8000
    """Control-plane port (replica i listens on port + i)."""
    replicas: int = 1
    """Control-plane processes on one database; node i's agent talks to replica i % replicas."""
    host: str = "127.0.0.1"
    """Control-plane listen address."""
    tls: bool = True
    """Serve the API over HTTPS, with a certificate from a local CA kept in DATA_DIR/tls that the
    agents (and the printed curl commands) trust; False: plain HTTP (``--insecure-http``)."""
    data_dir: Path = field(default_factory=lambda: Path(".trainyard/dev"))
    token: str | None = None
    """Admin token; None: a new random one."""
    database_url: str | None = None
    """Use this PostgreSQL (SQLAlchemy URL) instead of starting one."""
    s3_endpoint: str | None = None
    """host:port of an S3 server to use instead of starting one (needs both keys)."""
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    s3_bucket: str = "trainyard"
    s3_ca_file: Path | None = None
    """With an https:// s3_endpoint whose certificate a private CA signed: that CA's PEM file."""
    ready_timeout_s: float = 120.0
    """How long each startup wait (control plane ready, nodes registered) may take."""
    stop_grace_s: float = 10.0
    """Between SIGTERM and SIGKILL when stopping an agent or the control plane."""
    python: str = field(default_factory=lambda: sys.executable)
    """Interpreter that runs the control plane and the agents."""
    control_plane_env: dict[str, str] = field(default_factory=dict)
    """Extra control-plane settings (TRAINYARD_* variables), e.g. a short node-lost timeout."""
    agent_args: list[str] = field(default_factory=list)
    """Extra arguments for every agent (bench/recovery.py: a recovery mechanism's switch)."""
    agent_control_plane: dict[str, str] = field(default_factory=dict)
    """node name -> the control-plane URL its agent uses instead of its replica's (fault tests put
    a proxy there)."""
    standbys: int | None = None
    """Warm standby processes per agent (``--standbys``, node_agent/ranks/standby.py); None: the
    agent's default (``auto``, or TRAINYARD_AGENT_STANDBYS in the environment); 0: none."""
    network: Topology | None = None
    """``--netns``: each node in a network namespace of its own, on bridges joined by links with these
    limits (trainyard/dev/netns.py); the control plane and S3 listen on the layout's host address.
    None: every node on this machine's loopback (127.0.0.(i+1))."""
    worker_uids: str | None = DEV_WORKER_UIDS if os.geteuid() == 0 else None
    """The agents' worker uid pool (node_agent/confinement/isolation.py): by default, as root, every attempt
    runs as a uid of its own like in production; None: workers run as the agents' user (also what
    ``start`` falls back to, saying NOT_ISOLATED, where the pool cannot be used on this machine)."""

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser().resolve()
        if not 1 <= self.nodes <= 253:  # node i listens on 127.0.0.(i+1)
            raise ValueError("--nodes must be between 1 and 253")
        if self.gpus_per_node < 1:
            raise ValueError("--gpus-per-node must be at least 1")
        if not 1 <= self.replicas <= 16:
            raise ValueError("--replicas must be between 1 and 16")
        if not 1 <= self.port <= 65535 - self.replicas + 1:
            raise ValueError("--port must be 1-65535 (and leave room for the replicas' ports)")
        if self.database_url is not None and not self.database_url.startswith("postgresql"):
            raise ValueError("--database-url must be a postgresql:// or postgresql+psycopg:// URL")
        if self.s3_endpoint is not None:
            if not (self.s3_access_key and self.s3_secret_key):
                raise ValueError("--s3-endpoint needs --s3-access-key and --s3-secret-key-file "
                                 "(or TRAINYARD_S3_SECRET_KEY)")
            host_port, _ = split_endpoint(self.s3_endpoint)
            if "://" in host_port or ":" not in host_port:
                raise ValueError("--s3-endpoint must be host:port, http://host:port or https://host:port")
            if self.s3_ca_file is not None:
                if not self.s3_endpoint.startswith("https://"):
                    raise ValueError("--s3-ca-file needs an https:// --s3-endpoint")
                self.s3_ca_file = Path(self.s3_ca_file).expanduser().resolve()
                read_ca_pem(self.s3_ca_file)
        elif self.s3_access_key or self.s3_secret_key or self.s3_ca_file:
            raise ValueError("--s3-access-key/--s3-secret-key-file/--s3-ca-file only go with --s3-endpoint")
        if self.ready_timeout_s <= 0 or self.stop_grace_s <= 0:
            raise ValueError("timeouts must be > 0")
        if self.network is not None:
            self.network.validate(self.nodes)
            if self.host != "127.0.0.1":
                raise ValueError("--host goes without --netns: the control plane listens on the layout's host address")
            if self.s3_endpoint is not None and split_endpoint(self.s3_endpoint)[0].startswith(("127.", "localhost")):
                raise ValueError("with --netns, --s3-endpoint must be reachable from the nodes' namespaces, "
                                 "not a loopback address")
        bad = [k for k in self.control_plane_env if not k.startswith("TRAINYARD_")]
        if bad:
            raise ValueError(f"control-plane settings must be TRAINYARD_* variables, not {', '.join(bad)}")

    @property
    def api_url(self) -> str:
        return self.replica_url(0)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def tls_hosts(self) -> list[str]:
        """What the server certificate names: loopback, and the listen address unless a wildcard."""
        return ["127.0.0.1", "localhost", "::1", *([self.host] if self.host not in ("0.0.0.0", "::", "") else [])]

    def replica_url(self, index: int) -> str:
        reach = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"{self.scheme}://{reach}:{self.port + index}"


SECRET_ENV = frozenset({"TRAINYARD_TOKEN", "TRAINYARD_ADMIN_TOKEN", "TRAINYARD_S3_ACCESS_KEY",
                        "TRAINYARD_S3_SECRET_KEY", "TRAINYARD_DATABASE_URL", "TRAINYARD_JOIN_TOKEN"})
"""Variables of dev up's own environment its children do not inherit (the agents' workers could read
them where they run as the agents' user)."""
