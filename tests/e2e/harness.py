"""Fault injection for end-to-end tests: a dev cluster run in this process (so a test can kill,
freeze or restart each part of it) and a TCP proxy that can cut the way to a real S3 server.

Nothing here imitates a server: the control plane, the agents, torchrun, PostgreSQL and S3 are the
real ones; the test only breaks the processes and connections between them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.helpers import wait_for
from trainyard.dev import DevCluster, DevConfig
from trainyard.dev.netns import Topology


@dataclass
class Cluster:
    url: str
    token: str
    http: httpx.Client
    log: Path
    verify: Any = True
    """What a client verifies the cluster's certificate with (httpx's ``verify``): its CA."""

    def get(self, path: str, **kw: Any) -> Any:
        r = self.http.get(path, **kw)
        r.raise_for_status()
        return r.json()

    def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self.http.post("/v1/jobs", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.get(f"/v1/jobs/{job_id}")

    def wait_for(self, what: str | Callable[[], str], check: Callable[[], Any], timeout: float = 120.0,
                 every: float = 0.3) -> Any:
        def said() -> str:
            return f"{what() if callable(what) else what}; cluster log: {self.log}"
        return wait_for(check, timeout, every, what=said)

    def wait_state(self, job_id: str, states: set[str], timeout: float = 120.0) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            j = self.job(job_id)
            return j if j["state"] in states else None
        return self.wait_for(f"job {job_id} in {states}", check, timeout)


class TcpProxy:
    """Forwards ``127.0.0.1:port`` to ``target``. ``cut()`` resets every open connection and refuses
    new ones (the server looks down to its clients) until ``restore()``. A ``target`` of
    ``unix:<path>`` forwards to a unix socket (the embedded PostgreSQL listens on one only). ``blackhole()`` is a
    partition rather than an outage: connections stay open and new ones are accepted, but no byte
    gets through in either direction, so clients wait until their own timeouts; ``heal()`` resets
    what was held (its requests were lost) and forwards again."""

    def __init__(self, target: str) -> None:
        self.unix = target.removeprefix("unix:") if target.startswith("unix:") else None
        host, port = ("", "0") if self.unix else target.rsplit(":", 1)
        self.target = (host, int(port))
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._stopped = threading.Event()
        self._blackholed = threading.Event()
        self._accepting: threading.Thread | None = None
        self._start_accepting()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        sock.settimeout(0.2)
        return sock

    def _start_accepting(self) -> None:
        self._accepting = threading.Thread(target=self._accept_loop, args=(self._listener,), daemon=True)
        self._accepting.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed: cut or stopped
            if self._blackholed.is_set():
                with self._lock:
                    self._conns.add(client)  # held open, never answered, reset at heal()
                continue
            try:
                upstream = self._connect_upstream()
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _connect_upstream(self) -> socket.socket:
        if self.unix is None:
            sock = socket.create_connection(self.target, timeout=5)
        else:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(5)
                sock.connect(self.unix)
            except OSError:
                sock.close()
                raise
        # The timeout is the connect's only: an idle pooled connection (a database's, S3's) is not a
        # dead one. With it, a connection idle for 5 s was dropped here, and its client, not told,
        # lost the next request it sent on it ("Remote end closed connection without response").
        sock.settimeout(None)
        return sock

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                if not self._blackholed.is_set():
                    dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                self._drop(s)

    def _drop(self, sock: socket.socket) -> None:
        """End a connection that ended at one side: FIN to the other."""
        with self._lock:
            if sock not in self._conns:
                return  # ended already (by the other pump, or reset by cut() or heal())
            self._conns.discard(sock)
        # close() alone does not end a connection while the other pump thread is blocked in recv()
        # on it (the kernel keeps the socket until that call returns): the peer would learn of it
        # only when it next sent something, and that request would be lost. shutdown() sends the
        # FIN and wakes that recv().
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def _reset_all(self) -> None:
        """RST rather than FIN on every open connection: its client sees it break, not end."""
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()  # the pumps woken below leave them alone (_drop)
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.shutdown(socket.SHUT_RD)  # wakes a pump's recv(); sends nothing
            with contextlib.suppress(OSError):
                sock.close()  # the RST (SO_LINGER 0), once no recv() holds the socket

    def cut(self) -> None:
        self._listener.close()
        self._reset_all()

    def restore(self) -> None:
        self._listener = self._listen(self.port)
        self._start_accepting()

    def blackhole(self) -> None:
        self._blackholed.set()

    def heal(self) -> None:
        self._reset_all()
        self._blackholed.clear()

    def close(self) -> None:
        self._stopped.set()
        self.cut()


@dataclass
class LiveCluster(Cluster):
    """A dev cluster whose processes belong to this test: kill an agent, freeze a node, restart
    the control plane, cut S3."""

    dev: DevCluster = field(default=None)  # type: ignore[assignment]
    s3_proxy: TcpProxy | None = None
    agent_proxies: dict[str, TcpProxy] = field(default_factory=dict)
    """node name -> the proxy between its agent and the control plane (``proxy_agents``)."""
    s3: Any = None

    def node_processes(self, name: str) -> list[psutil.Process]:
        """The agent of node ``name`` and everything it started (torchrun, shims, workers)."""
        agent = psutil.Process(self.dev.agent(name).pid)
        return [agent, *agent.children(recursive=True)]

    def part_processes(self, name: str) -> list[psutil.Process]:
        """What attempts run on node ``name``: the agent's descendants but its warm standbys' zygote
        and unclaimed standbys (in the agent's own cgroup; a claimed one has joined its part's), and
        but the dead: a process that ended and waits to be reaped (a claimed standby is the zygote's
        child, and the zygote reaps once a second) runs nothing."""
        from node_agent.ranks.entry_points import STANDBY

        agent, *rest = self.node_processes(name)

        def cgroup(proc: psutil.Process) -> str | None:
            try:
                return Path(f"/proc/{proc.pid}/cgroup").read_text()
            except OSError:
                return None

        def the_agents(proc: psutil.Process) -> bool:
            with contextlib.suppress(psutil.Error):
                return (STANDBY in proc.cmdline()[:3] and cgroup(proc) == cgroup(agent)
                        and proc.uids().real == agent.uids().real)
            return False

        def running(proc: psutil.Process) -> bool:
            try:
                return proc.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False
        return [p for p in rest if running(p) and not the_agents(p)]

    def signal_node(self, name: str, sig: signal.Signals) -> list[psutil.Process]:
        procs = self.node_processes(name)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        return procs

    def node_id(self, name: str) -> str:
        return next(n["id"] for n in self.get("/v1/nodes") if n["name"] == name)

    def node(self, name: str) -> dict[str, Any]:
        return next(n for n in self.get("/v1/nodes") if n["name"] == name)

    def attempts(self, job_id: str) -> list[dict[str, Any]]:
        return self.get(f"/v1/jobs/{job_id}/attempts")["items"]

    def checkpoints(self, job_id: str, state: str | None = None) -> list[dict[str, Any]]:
        items = self.get(f"/v1/jobs/{job_id}/checkpoints")["items"]
        return [c for c in items if state is None or c["state"] == state]

    def events(self, job_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        items = self.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000})["items"]
        return [e for e in items if kind is None or e["kind"] == kind]

    def log_text(self, name: str) -> str:
        return (self.dev.logs_dir / f"{name}.log").read_text(errors="replace")

    def worker_pids(self, job_id: str) -> dict[int, tuple[str, int]]:
        """Running workers of the current attempt: rank -> (node name, pid)."""
        current = self.attempts(job_id)[-1]
        return {w["rank"]: (n["node_name"], w["pid"]) for n in current["nodes"] for w in n["workers"]
                if w["pid"] and w["state"] == "running"}


@contextlib.contextmanager
def live_cluster(
    tmp_path: Path, database_url: str, bucket: Any, *, nodes: int, gpus_per_node: int = 1,
    settings: dict[str, str] | None = None, proxy_s3: bool = False, replicas: int = 1,
    proxy_agents: tuple[str, ...] = (), network: Topology | None = None,
) -> Iterator[LiveCluster]:
    """Start a dev cluster of ``nodes`` agents on ``database_url`` and ``bucket`` (through a
    cuttable proxy with ``proxy_s3``; the agents named in ``proxy_agents`` reach the control plane
    through a proxy each); stop it, and every process it started, at the end. ``network``: each node
    in a network namespace of its own (trainyard/dev/netns.py; ``cluster.dev.network`` cuts links),
    and an S3 of the cluster's own on the layout's host address, which the nodes can reach."""
    proxy = TcpProxy(bucket.endpoint) if proxy_s3 else None
    port = _free_port_run(replicas)
    agent_proxies = {}
    for name in proxy_agents:
        replica = (int(name.rsplit("-", 1)[1]) - 1) % replicas
        agent_proxies[name] = TcpProxy(f"127.0.0.1:{port + replica}")
    data_dir = tmp_path / "cluster"
    config = DevConfig(
        nodes=nodes, gpus_per_node=gpus_per_node, port=port, replicas=replicas, data_dir=data_dir, token="e2e-admin",
        database_url=database_url, network=network,
        **({} if network is not None else {
            "s3_endpoint": proxy.endpoint if proxy else bucket.endpoint, "s3_access_key": bucket.access_key,
            "s3_secret_key": bucket.secret_key, "s3_bucket": bucket.bucket}),
        stop_grace_s=3.0, control_plane_env=settings or {},
        # TLS end to end through the proxy: the agent verifies the control plane's certificate
        # (it names 127.0.0.1, whatever the port).
        agent_control_plane={name: f"https://{p.endpoint}" for name, p in agent_proxies.items()},
    )
    log = tmp_path / "dev.log"
    out = log.open("w")
    dev = DevCluster(config, out)
    http: httpx.Client | None = None
    try:
        dev.start()
        assert config.api_url.startswith("https://") and dev.tls is not None  # dev up's default
        http = httpx.Client(base_url=config.api_url, headers={"Authorization": f"Bearer {dev.token}"}, timeout=30,
                            verify=dev.verify)
        yield LiveCluster(url=config.api_url, token=dev.token, http=http, log=dev.logs_dir, dev=dev,
                          s3_proxy=proxy, s3=bucket if network is None else None, agent_proxies=agent_proxies,
                          verify=dev.verify)
    finally:
        if http is not None:
            http.close()
        for directory in dev.worker_dirs:
            for p in _processes_under(directory):  # frozen ones first get to die, not to wait for a CONT
                with contextlib.suppress(psutil.Error):
                    p.send_signal(signal.SIGCONT)
        dev.stop()
        for directory in dev.worker_dirs:
            _kill_processes_under(directory)  # orphans of a SIGKILLed agent: workers in their own sessions
        for p in [proxy, *agent_proxies.values()]:
            if p is not None:
                p.close()
        out.close()


def _free_port_run(count: int) -> int:
    """The first of ``count`` consecutive free ports (control-plane replicas listen on port + i)."""
    from trainyard.embedded import free_port, port_is_free

    for _ in range(100):
        first = free_port()
        if all(port_is_free(first + i) for i in range(count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _processes_under(directory: Path) -> list[psutil.Process]:
    """Processes whose working directory lies under ``directory`` (workers run in attempt dirs)."""
    prefix = str(directory.resolve())
    found = []
    for p in psutil.process_iter(["cwd"]):
        cwd = p.info.get("cwd") or ""
        if p.pid != os.getpid() and (cwd == prefix or cwd.startswith(prefix + os.sep)):
            found.append(p)
    return found


def _kill_processes_under(directory: Path) -> None:
    procs = _processes_under(directory)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=5)
