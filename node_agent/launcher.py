"""Start this node's part of an attempt: one torchrun, whose ranks run under node_agent.rank_shim.

Layout of an attempt's directory, work_dir/attempts/<attempt_id>/ (also the workers' cwd):

    state.json            spec, torchrun pid/pgid, final status (see attempt.py); survives restarts
    torchrun.stdout.log   torchrun's own output (rendezvous, failures), not shipped
    torchrun.stderr.log
    status/rank-<R>.json  one per global rank, written by the rank shim
    logs/rank-<R>/stdout.log, logs/rank-<R>/stderr.log   each rank's output, shipped by offset

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
from typing import Any

import node_agent
from trainyard.protocol.agent import LaunchSpec
from trainyard.protocol.env import (
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
    ENV_NODE_ID,
    ENV_NODE_NAME,
    ENV_NODE_RANK,
    ENV_RESTORE_FROM,
    ENV_STATUS_DIR,
    ENV_STORAGE_ACCESS,
    PREFIX,
)

# LaunchSpec.storage key -> worker variable. Nothing else of LaunchSpec.storage reaches a worker:
# whatever a control plane sends, no storage credential does (docs/security.md).
_STORAGE_ENV = {"access": ENV_STORAGE_ACCESS, "prefix": ENV_CHECKPOINT_PREFIX}

# The package root, so that `-m node_agent.rank_shim` imports from any cwd without an install.
_PACKAGE_ROOT = str(Path(node_agent.__file__).resolve().parent.parent)


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
    """Environment every worker inherits; None means this process's environment."""
    node_name: str = ""
    """Given to every process as TRAINYARD_NODE_NAME (informational)."""
    node_id: str = ""
    """Given to every process as TRAINYARD_NODE_ID: the marker a later agent instance of this node
    finds its orphaned workers by (node_agent/orphans.py). Known once the agent registered."""
    cwd: str = field(default_factory=os.getcwd)
    """Relative entrypoint paths and top-level modules resolve against this directory, as if the
    job had been started by hand where the agent was started."""

    def __post_init__(self) -> None:
        if self.join_timeout_s <= 0 or self.shutdown_timeout_s < 0 or self.monitor_interval_s <= 0:
            raise ValueError("timeouts must be positive")


@dataclass(frozen=True)
class AttemptPaths:
    root: Path

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def status_dir(self) -> Path:
        return self.root / "status"

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

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


def torchrun_command(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths) -> list[str]:
    kind = entrypoint_kind(spec.entrypoint)
    entrypoint = spec.entrypoint
    if kind == "file":
        entrypoint = os.path.join(node.cwd, entrypoint)  # no-op for an absolute path
    return [
        node.python, "-m", "torch.distributed.run",
        "--nnodes", str(spec.nnodes),
        "--nproc-per-node", str(spec.nproc_per_node),
        # torchrun's group rank is the control plane's node rank (see the module docstring).
        "--node-rank", str(spec.node_rank),
        "--rdzv-backend", "static",
        "--rdzv-endpoint", _endpoint(spec.rdzv_host, spec.rdzv_port),
        "--rdzv-id", spec.attempt_id,
        # How long node rank 0 waits for the others to connect, and they for it.
        "--rdzv-conf", f"timeout={node.join_timeout_s}",
        "--local-addr", node.local_addr,
        # Recovery is the control plane's decision (a new attempt from a checkpoint), not torchrun's.
        "--max-restarts", "0",
        "--monitor-interval", str(node.monitor_interval_s),
        "--shutdown-timeout", str(node.shutdown_timeout_s),
        "-m", "node_agent.rank_shim",
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


def worker_env(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths) -> dict[str, str]:
    inherited = os.environ if node.base_env is None else node.base_env
    # The agent's own TRAINYARD_* settings (a join token, say) are none of the job's business.
    env = {k: v for k, v in inherited.items() if not k.startswith(PREFIX)}
    pythonpath = [_PACKAGE_ROOT, node.cwd, *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(pythonpath))
    # Defaults the job may override.
    env["PYTHONUNBUFFERED"] = "1"  # logs reach the files (and the user) as they are written
    if node.virtual:
        env["OMP_NUM_THREADS"] = "1"  # ranks share the CPU cores; oversubscription crawls
    if _is_loopback(node.local_addr):
        # Several nodes may share this machine on 127.0.0.N; gloo must not pick an external NIC.
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(spec.env)
    # What the agent guarantees, whatever the job asked for.
    env.update(device_env(spec, node))
    env.update(storage_env(spec.storage))
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
            # torchrun 2.x can hang at shutdown when workers share the rendezvous TCP store.
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
    )
    if spec.layout is not None:
        env[ENV_LAYOUT] = spec.layout.model_dump_json()
    if node.node_name:
        env[ENV_NODE_NAME] = node.node_name
    if node.node_id:
        env[ENV_NODE_ID] = node.node_id
    return env


def start_torchrun(spec: LaunchSpec, node: NodeContext, paths: AttemptPaths) -> subprocess.Popen[bytes]:
    """Start torchrun in its own session, so that a Ctrl-C or signal aimed at the agent's group
    spares it (the agent stops workers itself, or leaves them for its successor). torchrun puts
    each rank in yet another session: processes.py finds them all. The attempt directory must
    already exist."""
    paths.status_dir.mkdir(exist_ok=True)
    paths.log_dir.mkdir(exist_ok=True)
    with paths.torchrun_stdout.open("ab") as out, paths.torchrun_stderr.open("ab") as err:
        return subprocess.Popen(
            torchrun_command(spec, node, paths),
            cwd=paths.root,
            env=worker_env(spec, node, paths),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
