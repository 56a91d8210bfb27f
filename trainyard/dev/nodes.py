"""The node agents of a ``dev up``: their command lines, join tokens and worker directories, the
check of the worker uid pool, and ``trainyard dev node kill|kill-workers|restart`` on a node."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

from trainyard.dev import control as dev_control
from trainyard.dev.base import ClusterBase
from trainyard.dev.certs import ensure_server_tls
from trainyard.dev.config import DevError
from trainyard.dev.processes import Child, descendants, is_training, kill_all, recorded_workers
from trainyard.embedded import signal_group


class _PoolCheck:
    """Whether the agents' worker uid pool works on this machine, found in a thread of its own:
    the agent's own start check (node_agent/confinement/isolation.py), run as root, with the agents' cwd. A
    ``dev up`` where it fails (no mount namespaces for a Python in a private /root, say) runs its
    workers unisolated and says so, rather than not starting at all."""

    def __init__(self, uids: str) -> None:
        self._uids = uids
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="dev-pool-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from node_agent.config import default_run_dir
        from node_agent.confinement.isolation import Isolation, UidRange

        try:
            Isolation.configure(UidRange.parse(self._uids), default_run_dir(), use_cgroups=False, cwd=os.getcwd())
        except Exception as exc:  # any reason at all: said, and the cluster still starts
            self._problem = f"{type(exc).__name__}: {exc}"

    def problem(self) -> str | None:
        self._thread.join()
        return self._problem


class NodeAgents(ClusterBase):
    """One agent per node (node i at 127.0.0.(i+1), virtual GPU slots), started, restarted, killed."""

    def node_address(self, i: int) -> str:
        """Node ``i``'s address: in its namespace with --netns, else 127.0.0.(i+1)."""
        return self.network.layout.node_address(i) if self.network is not None else f"127.0.0.{i + 1}"

    def _spawn_agent(self, i: int) -> Child:
        prefix = self.network.exec_prefix(i) if self.network is not None else None
        return self._spawn(f"node-{i}", self._agent_args(i), {}, prefix)

    def _agent_args(self, i: int) -> list[str]:
        cfg = self.config
        name = f"node-{i}"
        address = self.node_address(i)
        args = [
            "-m", "trainyard", "agent",
            "--control-plane", cfg.agent_control_plane.get(name) or cfg.replica_url((i - 1) % cfg.replicas),
            "--join-token-file", str(self.join_token_file(name)),
            "--name", name,
            "--address", address,
            "--virtual-gpus", str(cfg.gpus_per_node),
            "--work-dir", str(cfg.data_dir / "nodes" / name),
            *(["--ca-file", str(self.tls.ca_file)] if self.tls else []),
        ]  # fmt: skip
        if self.tls:
            # The node's own certificate, from the cluster's CA: its memory port speaks TLS and its
            # peers verify it with the same --ca-file (docs/security.md, "TLS").
            node_tls = ensure_server_tls(cfg.data_dir / "tls", [address], common_name=f"trainyard {name}",
                                         stem=name)
            args += ["--memory-tls-cert", str(node_tls.cert_file), "--memory-tls-key", str(node_tls.key_file)]
        else:  # --insecure-http: the operator chose plain HTTP for the whole cluster
            args += ["--memory-plain-http"]
        if cfg.worker_uids:
            args += ["--worker-uids", cfg.worker_uids, "--worker-root", str(self._worker_root(name))]
        if cfg.standbys is not None:
            args += ["--standbys", str(cfg.standbys)]
        if self.network is not None:  # the scheduler keeps a gang inside a rack when it can
            args += ["--label", f"rack=r{self.network.layout.rack_of(i)}"]
        return args + list(cfg.agent_args)

    def _worker_root(self, name: str) -> Path:
        """Where node ``name``'s workers get their directories: under its work dir when worker
        uids can get there, else in a directory of this data dir's under the temporary directory
        (a pytest tmp_path is 0700)."""
        node_dir = self.config.data_dir / "nodes" / name
        if _reachable(node_dir.parent):
            return node_dir / "workers"
        return self._workers_tmp / name

    @property
    def worker_dirs(self) -> list[Path]:
        """Where this cluster's workers run (their cwd lies below one of these)."""
        return [self.config.data_dir, self._workers_tmp]

    @property
    def _workers_tmp(self) -> Path:
        digest = hashlib.sha256(str(self.config.data_dir).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"trainyard-dev-workers-{digest}"

    def join_token_file(self, name: str) -> Path:
        """Where node ``name``'s join token is (0600): made by ``dev up`` through the API, bound to the
        name, reusable for 30 days, so that the dev cluster's agents restart, even with a wiped work
        dir. A production agent gets a single-use one (docs/security.md)."""
        return self.config.data_dir / "nodes" / f"{name}.join-token"

    def _make_join_token(self, name: str) -> None:
        import httpx

        try:
            resp = httpx.post(f"{self.config.api_url}/v1/join-tokens", timeout=10.0, verify=self.verify,
                              headers={"Authorization": f"Bearer {self.token}"},
                              json={"node_name": name, "ttl_s": 30 * 86400, "max_uses": None,
                                    "description": "trainyard dev up"})
        except httpx.HTTPError as exc:
            raise DevError(f"could not create a join token for {name}: {exc}") from exc
        if resp.status_code != 201:
            raise DevError(f"could not create a join token for {name}: HTTP {resp.status_code} {resp.text[:200]}")
        path = self.join_token_file(name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(resp.json()["token"] + "\n")

    def start_agent(self, name: str) -> subprocess.Popen[bytes]:
        """Start node ``name``'s agent again, on the same work dir, after its process ended (it was
        killed, or the test simulates a reboot: everything killed, the disk kept)."""
        index = next(i for i, child in enumerate(self.agents) if child.name == name)
        old = self.agents[index]
        if old.proc.poll() is None:
            raise DevError(f"the agent of {name} still runs (pid {old.proc.pid})")
        old.log.close()
        self.agents[index] = self._spawn_agent(int(name.rsplit("-", 1)[1]))
        return self.agents[index].proc

    def node_action(self, action: str, name: str) -> str:
        """``trainyard dev node ...``: kill a node (its agent and its workers, SIGKILL: a node that
        died), kill its workers only (a crashed training process), or restart its agent."""
        if name not in {child.name for child in self.agents}:
            raise dev_control.ControlError(f"no node {name!r} in this cluster "
                                           f"({', '.join(c.name for c in self.agents)})")
        proc = self.agent(name)
        if action == "restart":
            if proc.poll() is None:
                raise dev_control.ControlError(f"{name}'s agent still runs (pid {proc.pid}); kill it first")
            self._reported_dead.discard(name)
            self._say(f"starting {name}'s agent again")
            return f"{name}: agent started again (pid {self.start_agent(name).pid})"
        root = self._worker_root(name) if self.config.worker_uids else self.config.data_dir / "nodes" / name / "workers"
        recorded = recorded_workers(root, agent=proc.pid)
        alive = proc.poll() is None
        workers = [p for p in descendants(proc.pid) if is_training(p) or p.pid in recorded] if alive else []
        if action == "kill-workers":
            if not workers:
                raise dev_control.ControlError(f"{name} runs no training process now")
            kill_all(workers)
            self._say(f"killed {len(workers)} training process(es) of {name} as asked")
            return f"{name}: killed {len(workers)} training process(es) (pids {', '.join(str(p.pid) for p in workers)})"
        if proc.poll() is not None:
            raise dev_control.ControlError(f"{name}'s agent is not running")
        self._reported_dead.add(name)
        everything = descendants(proc.pid)
        signal_group(proc, signal.SIGKILL)
        kill_all(everything)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        self._say(f"killed {name} (its agent and {len(everything)} process(es) under it) as asked")
        return f"{name}: killed its agent and {len(everything)} process(es) under it"

    def agent(self, name: str) -> subprocess.Popen[bytes]:
        """The process of the agent of node ``name`` (node-1, node-2, ...)."""
        for child in self.agents:
            if child.name == name:
                return child.proc
        raise KeyError(f"no agent named {name!r}")

    def _nodes_ready(self) -> bool:
        import httpx

        try:
            resp = httpx.get(
                f"{self.config.api_url}/v1/nodes",
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=2.0,
                verify=self.verify,
            )
        except httpx.HTTPError:
            return False
        if resp.status_code != 200:
            return False
        body = resp.json()
        items = body if isinstance(body, list) else body.get("items", [])
        wanted = {f"node-{i}" for i in range(1, self.config.nodes + 1)}
        ready = {n.get("name") for n in items if str(n.get("state", "")).lower() == "ready"}
        return wanted <= ready


def _reachable(path: Path) -> bool:
    """Every directory from / down to ``path`` lets other users through (o+x)."""
    path = path.resolve()
    return all(d.exists() and d.stat().st_mode & stat.S_IXOTH for d in (*path.parents, path))


def _own_dir(path: Path) -> None:
    """``path`` as a directory of this user's that others may only pass through (0711); refuse one
    someone else made first (it is under the shared temporary directory)."""
    path.mkdir(mode=0o711, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise DevError(f"{path} exists and is not this user's directory; remove it")
    path.chmod(0o711)
