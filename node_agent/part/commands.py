"""What this node's part of an attempt runs: the command lines of its one torchrun (started through
node_agent.ranks.torchrun_entry, whose ranks run under node_agent.ranks.shim) or of a job's own
command, their environment, and the part's directories (AttemptPaths). parts.py starts them.

Two directories per attempt part. The agent's own, work_dir/attempts/<attempt_id>/ (0700, the
agent's user; workers cannot read it):

    state.json            spec, torchrun pid/pgid, uid and cgroup, final status (see attempt.py);
                          survives restarts; holds the fencing token (0600)
    torchrun.stdout.log   torchrun's own output (rendezvous, failures), not shipped; written through
    torchrun.stderr.log   descriptors the agent opened, so a worker cannot redirect them

and the worker directory, worker_root/<attempt_id>.<node_rank>/ (0700, the attempt's uid: see
isolation.py), the workers' cwd, removed once the attempt is done:

    home/                 HOME (torch's compile and cache directories land here)
    tmp/                  TMPDIR only where the short one (isolation.worker_tmp: /tmp/trainyard-<uid>/<hash>,
                          so unix socket paths under it fit 108 bytes) cannot be made
    status/rank-<R>.json  one per global rank, written by the rank shim, read back with care
                          (safe_files.py: a worker may plant links or FIFOs there)
    logs/rank-<R>/stdout.log, logs/rank-<R>/stderr.log   each rank's output, shipped by offset

torchrun's environment is built from an allow-list (worker_env), not from the agent's: nothing of
the agent's (its join token, its TRAINYARD_* settings) reaches it, and the job's own env is handed
to the rank shim in TRAINYARD_JOB_ENV, which applies it to the training process alone.

Rendezvous is torchrun's static backend on the attempt's own port at node rank 0's address, with
``--node-rank`` set to the control plane's node rank: torchrun's group rank is then that node
rank, and global rank = node rank x nproc-per-node + local rank. The control plane orders node
ranks by topology (same rack adjacent) and a node's ranks are contiguous, so a layout's inner
mesh dimension (HSDP's shard group, worker_runtime/layouts.py) stays inside a node. The c10d
backend would renumber the nodes by sorting their addresses. Node rank 0 hosts the store (never a
guess from its address: several "nodes" may share one machine on different loopback addresses).
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

import node_agent
from node_agent.confinement.isolation import worker_tmp
from node_agent.ranks.entry_points import RANK_SHIM, TORCHRUN_ENTRY
from trainyard.protocol.agent import LaunchSpec
from trainyard.protocol.env import (
    ENV_AGENT_SOCKET,
    ENV_AGENT_URL,
    ENV_ATTEMPT_ID,
    ENV_ATTEMPT_NUMBER,
    ENV_CHECKPOINT,
    ENV_CHECKPOINT_PREFIX,
    ENV_DEVICE,
    ENV_FENCING_TOKEN,
    ENV_JOB_ENV,
    ENV_JOB_ID,
    ENV_JOB_NAME,
    ENV_LAYOUT,
    ENV_LOCAL_ADDR,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_NNODES,
    ENV_NODE_ID,
    ENV_NODE_NAME,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_RENDEZVOUS,
    ENV_RESTORE_FROM,
    ENV_S3_CA_PEM,
    ENV_STANDBY_DIR,
    ENV_STATUS_DIR,
    ENV_STORAGE_ACCESS,
    ENV_WORLD_SIZE,
    PREFIX,
)
from trainyard.protocol.restart import Rendezvous

if TYPE_CHECKING:
    from node_agent.confinement.isolation import Confinement

# LaunchSpec.storage key -> worker variable. Nothing else of LaunchSpec.storage reaches a worker:
# whatever a control plane sends, no storage credential does (docs/security.md).
_STORAGE_ENV = {"access": ENV_STORAGE_ACCESS, "prefix": ENV_CHECKPOINT_PREFIX, "ca_pem": ENV_S3_CA_PEM}

# The package root, so that `-m node_agent.ranks.shim` imports from any cwd without an install.
_PACKAGE_ROOT = str(Path(node_agent.__file__).resolve().parent.parent)

PASSTHROUGH_ENV = frozenset({
    "PATH", "PYTHONPATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy",
    "no_proxy",
})
"""The agent's variables torchrun and the workers inherit (PATH and PYTHONPATH extended, below);
everything else of the agent's environment stays with the agent."""
PASSTHROUGH_PREFIXES = ("LC_", "NCCL_")
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True, kw_only=True)
class NodeContext:
    """What the launcher needs to know about this node, the same for every attempt."""

    local_addr: str
    """This node's address: torchrun's --local-addr, hence MASTER_ADDR when it is group rank 0."""
    agent_url: str
    """The local API's URL, given to workers as TRAINYARD_AGENT_URL."""
    virtual: bool
    """Virtual CPU slots (gloo, no CUDA) rather than NVIDIA GPUs."""
    join_timeout_s: int = 300
    """How long torchrun waits for the other nodes of the attempt to join the rendezvous."""
    shutdown_timeout_s: int = 5
    """torchrun's own TERM-to-KILL delay when it tears its workers down after a rank failed."""
    monitor_interval_s: float = 0.5
    """How often torchrun checks its workers, hence how soon it notices a failed rank."""
    python: str = field(default=sys.executable)
    base_env: dict[str, str] | None = None
    """The environment the PASSTHROUGH_ENV names are taken from; None means this process's."""
    env_passthrough: tuple[str, ...] = ()
    """More of the agent's variables to pass on (an operator's choice, e.g. a site's NCCL or proxy
    settings); never a TRAINYARD_* one."""
    node_name: str = ""
    """Given to every process as TRAINYARD_NODE_NAME (informational)."""
    node_id: str = ""
    """Given to every process as TRAINYARD_NODE_ID: the marker a later agent instance of this node
    finds its orphaned workers by (node_agent/ranks/orphans.py). Known once the agent registered."""
    standby_dir: str | None = None
    """Where this agent's warm standbys listen (TRAINYARD_STANDBY_DIR for the rank shims), when it
    keeps any (``--standbys``)."""
    allowed_pythons: tuple[str, ...] = ()
    """The interpreters the operator listed (``--allowed-python``): a job's venv build may see their
    installations when they are below a private directory (node_agent/part/attempt.py, _builder)."""
    cwd: str = field(default_factory=os.getcwd)
    """Relative entrypoint paths and top-level modules resolve against this directory, as if the
    job had been started by hand where the agent was started."""

    def __post_init__(self) -> None:
        if self.join_timeout_s <= 0 or self.shutdown_timeout_s < 0 or self.monitor_interval_s <= 0:
            raise ValueError("timeouts must be positive")
        if any(name.startswith(PREFIX) for name in self.env_passthrough):
            raise ValueError("the agent's TRAINYARD_* variables are never passed to workers")


@dataclass(frozen=True)
class AttemptPaths:
    root: Path
    """The agent's private directory of the attempt."""
    worker: Path = None  # type: ignore[assignment]
    """The worker directory (cwd, HOME, TMPDIR, rank status, logs); default root/worker."""
    socket: Path | None = None
    """The local API's socket for this attempt part (TRAINYARD_AGENT_SOCKET), when served."""

    def __post_init__(self) -> None:
        if self.worker is None:
            object.__setattr__(self, "worker", self.root / "worker")

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def status_dir(self) -> Path:
        return self.worker / "status"

    @property
    def log_dir(self) -> Path:
        return self.worker / "logs"

    @property
    def torchrun_stdout(self) -> Path:
        return self.root / "torchrun.stdout.log"

    @property
    def torchrun_stderr(self) -> Path:
        return self.root / "torchrun.stderr.log"


def entrypoint_kind(entrypoint: str) -> str:
    """'file' for a script path (ends with .py or contains '/'), else 'module'."""
    return "file" if entrypoint.endswith(".py") or "/" in entrypoint else "module"


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def interface_of(address: str) -> str | None:
    """The name of this machine's (this network namespace's) interface that holds ``address``; None
    when none does (an address behind NAT, a name)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None


def torchrun_command(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths) -> list[str]:
    kind = entrypoint_kind(spec.entrypoint)
    entrypoint = spec.entrypoint
    if kind == "file":
        entrypoint = os.path.join(node.cwd, entrypoint)  # no-op for an absolute path
    if spec.restartable:
        # A local supervisor only: its workers join the attempt's fenced rendezvous themselves (the
        # rank shim sets their global ranks), so no torchrun store spans nodes, and a worker can
        # outlive this attempt and join the next one (docs/architecture.md, "In-process restart").
        nodes = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.nproc_per_node)]
    else:
        nodes = [
            "--nnodes", str(spec.nnodes),
            "--nproc-per-node", str(spec.nproc_per_node),
            # torchrun's group rank is the control plane's node rank (see the module docstring).
            "--node-rank", str(spec.node_rank),
            "--rdzv-backend", "static",
            "--rdzv-endpoint", _endpoint(spec.rdzv_host, spec.rdzv_port),
            "--rdzv-id", spec.attempt_id,
            # How long node rank 0 waits for the others to connect, and they for it.
            "--rdzv-conf", f"timeout={node.join_timeout_s}",
        ]
    # torchrun through node_agent.ranks.torchrun_entry: a node other than the static rendezvous's host
    # waits for the host's port to accept before torchrun connects, which spares it torch's connect
    # backoff when it finished importing first (trainyard/protocol/rendezvous.py).
    wait = [] if spec.restartable or spec.node_rank == 0 else [
        "--wait-for", _endpoint(spec.rdzv_host, spec.rdzv_port), "--wait-s", str(node.join_timeout_s)]
    return [
        node.python, "-m", TORCHRUN_ENTRY, *wait, "--",
        *nodes,
        "--local-addr", node.local_addr,
        # Recovery is the control plane's decision (a new attempt from a checkpoint), not torchrun's.
        "--max-restarts", "0",
        "--monitor-interval", str(node.monitor_interval_s),
        "--shutdown-timeout", str(node.shutdown_timeout_s),
        "-m", RANK_SHIM,
        "--log-dir", str(paths.log_dir),
        kind, entrypoint, *spec.args,
    ]  # fmt: skip


def device_env(spec: LaunchSpec, node: NodeContext) -> dict[str, str]:
    if node.virtual:
        return {ENV_DEVICE: "cpu", "CUDA_VISIBLE_DEVICES": ""}
    return {
        ENV_DEVICE: "cuda",
        # NVML numbers GPUs in PCI bus order; make CUDA agree so the leased indices are the right GPUs.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in spec.gpu_indices),
    }


def storage_env(storage: Mapping[str, Any]) -> dict[str, str]:
    """TRAINYARD_STORAGE_ACCESS and TRAINYARD_CHECKPOINT_PREFIX for the keys `storage` has: how a
    worker reaches checkpoint storage (presigned URLs through this agent), never a credential."""
    return {name: str(storage[key]) for key, name in _STORAGE_ENV.items() if storage.get(key) is not None}


def _passes(name: str, extra: tuple[str, ...]) -> bool:
    return (name in PASSTHROUGH_ENV or name.startswith(PASSTHROUGH_PREFIXES) or name in extra) \
        and not name.startswith(PREFIX)


def node_env(node: NodeContext) -> dict[str, str]:
    """What every process the agent starts for this node gets before anything of an attempt: an
    allow-list of the agent's variables and the platform's defaults. A warm standby starts with it
    alone (standby_env), so what it read while importing is what a cold worker reads."""
    inherited = os.environ if node.base_env is None else node.base_env
    env = {k: v for k, v in inherited.items() if _passes(k, node.env_passthrough)}
    path = [str(Path(node.python).parent), *(env.get("PATH") or DEFAULT_PATH).split(os.pathsep)]
    env["PATH"] = os.pathsep.join(dict.fromkeys(filter(None, path)))
    pythonpath = [_PACKAGE_ROOT, node.cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pythonpath))
    # Defaults the job may override (in its training process).
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the files (and the user) as they are written
    if node.virtual:
        env["OMP_NUM_THREADS"] = "1"  # ranks share the CPU cores; oversubscription crawls
    if _is_loopback(node.local_addr):
        # Several nodes may share this machine on 127.0.0.N; gloo must not pick an external NIC.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    elif (interface := interface_of(node.local_addr)) is not None:
        # gloo otherwise takes the address the host name resolves to, which need not be the node's
        # registered one (or exist at all: a node in a network namespace of its own, dev up --netns).
        env["GLOO_SOCKET_IFNAME"] = interface
    # torchrun 2.x can hang at shutdown when workers share the rendezvous TCP store.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def standby_env(node: NodeContext) -> dict[str, str]:
    """A warm standby's environment (node_agent/ranks/standby_pool.py): node_env, no GPU (it must never
    create a CUDA context: no GPU memory while idle), a HOME and TMPDIR that do not exist."""
    env = node_env(node)
    # What torchrun adds to every worker's environment by default (torch.distributed.elastic's
    # local agent; OMP_NUM_THREADS when a node runs more than one rank): a standby must have
    # imported with them, or it declines the rank (node_agent/ranks/standby_wire.py, STARTUP_PREFIXES).
    env.setdefault("OMP_NUM_THREADS", "1")
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["HOME"] = env["TMPDIR"] = "/nonexistent"
    return env


def worker_env(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths, *, uid: int | None = None) -> dict[str, str]:
    """torchrun's environment (the shims and the workers inherit it): an allow-list of the agent's
    variables, the platform's settings, and the job's env in ENV_JOB_ENV for the shim to apply to
    the training process only (node_agent/ranks/shim.py, child_env)."""
    inherited = os.environ if node.base_env is None else node.base_env
    env = node_env(node)
    # The attempt's own: torch's compile caches, pip's and HF's caches, temporary files.
    env["HOME"], env["TMPDIR"] = str(paths.worker / "home"), str(worker_tmp(paths.worker))
    if uid is not None:
        env["USER"] = env["LOGNAME"] = f"trainyard-{uid}"  # getpass works without a passwd entry
    else:
        env.update({k: inherited[k] for k in ("USER", "LOGNAME") if k in inherited})
    # What the agent guarantees, whatever the job asked for.
    env.update(device_env(spec, node))
    env.update(storage_env(spec.storage))
    if node.standby_dir is not None:
        env[ENV_STANDBY_DIR] = node.standby_dir
        # What torchrun gives every rank anyway, in torchrun's own environment too: its warm start
        # (node_agent/ranks/torchrun_entry.py) needs the startup variables a standby imported with.
        env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(
        {
            ENV_JOB_ID: spec.job_id,
            ENV_JOB_NAME: spec.job_name,
            ENV_ATTEMPT_ID: spec.attempt_id,
            ENV_ATTEMPT_NUMBER: str(spec.attempt_number),
            ENV_FENCING_TOKEN: spec.fencing_token,
            ENV_AGENT_URL: node.agent_url,
            ENV_NODE_RANK: str(spec.node_rank),
            ENV_CHECKPOINT: json.dumps(spec.checkpoint),
            ENV_RESTORE_FROM: json.dumps(spec.restore_from.model_dump(mode="json") if spec.restore_from else None),
            ENV_STATUS_DIR: str(paths.status_dir),
            ENV_JOB_ENV: json.dumps(spec.env),
        }
    )
    if spec.restartable:
        env[ENV_RENDEZVOUS] = Rendezvous(host=spec.rdzv_host, port=spec.rdzv_port).to_env()
        env[ENV_NNODES] = str(spec.nnodes)
    if paths.socket is not None:
        env[ENV_AGENT_SOCKET] = str(paths.socket)
    if spec.layout is not None:
        env[ENV_LAYOUT] = spec.layout.model_dump_json()
    if node.node_name:
        env[ENV_NODE_NAME] = node.node_name
    if node.node_id:
        env[ENV_NODE_ID] = node.node_id
    return env


# --- `command` jobs (LaunchSpec.command; docs/writing-jobs.md, "Jobs that bring their own launcher") ---


def command_argv(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths) -> list[str]:
    """The part of a ``command`` job: the job's argv under one rank shim (``command`` kind), in place of
    torchrun. The shim records the part as one worker (the node's first global rank, local rank 0) with
    the command's exact exit, and writes its output where every rank's is shipped from. argv[0] is not
    looked at here beyond its spelling: a bare name is found on PATH by the shim, after the uid switch;
    a relative path is made absolute against the job's code (node.cwd), like a file entrypoint."""
    assert spec.command
    program, *rest = spec.command
    if "/" in program:
        program = os.path.join(node.cwd, program)  # no-op for an absolute path
    return [node.python, "-m", RANK_SHIM, "--log-dir", str(paths.log_dir), "command", program, *rest]


def command_env(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths, *, uid: int | None = None) -> dict[str, str]:
    """worker_env plus the contract a job's own launcher starts its processes with: the node rank,
    node count, processes per node and world size, and the rendezvous (node rank 0's address and the
    attempt's own port), both as torchrun's usual names and as TRAINYARD_* ones."""
    env = worker_env(spec, node, paths, uid=uid)
    world = spec.nnodes * spec.nproc_per_node
    contract = {
        ENV_NNODES: str(spec.nnodes), ENV_NPROC_PER_NODE: str(spec.nproc_per_node), ENV_WORLD_SIZE: str(world),
        ENV_MASTER_ADDR: spec.rdzv_host, ENV_MASTER_PORT: str(spec.rdzv_port), ENV_LOCAL_ADDR: node.local_addr,
        "MASTER_ADDR": spec.rdzv_host, "MASTER_PORT": str(spec.rdzv_port), "NODE_RANK": str(spec.node_rank),
        "NNODES": str(spec.nnodes), "NPROC_PER_NODE": str(spec.nproc_per_node),
    }
    env.update(contract)
    return env


def start_torchrun(
    spec: LaunchSpec, node: NodeContext, paths: AttemptPaths, confinement: Confinement | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start torchrun in its own session, so that a Ctrl-C or signal aimed at the agent's group
    spares it (the agent stops workers itself, or leaves them for its successor); confined
    (isolation.py) when ``confinement`` says so. torchrun puts each rank in yet another session:
    the attempt's cgroup, uid or markers find them all (processes.py). Both directories must
    exist. ``cwd``: where the workers run (the job's unpacked code), else the worker directory. A
    ``command`` job's part is its command under a rank shim instead (command_argv), started the same
    way: through the same confinement, in the same session and files."""
    command = command_argv(spec, node, paths) if spec.command else torchrun_command(spec, node, paths)
    uid = None
    if confinement is not None:
        command, uid = confinement.wrap(command), confinement.uid  # node.python only after the switch
    make_env = command_env if spec.command else worker_env
    with paths.torchrun_stdout.open("ab") as out, paths.torchrun_stderr.open("ab") as err:
        return subprocess.Popen(
            command,
            cwd=cwd or paths.worker,
            env=make_env(spec, node, paths, uid=uid),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
