"""``trainyard dev up``: a whole cluster on this machine, in the foreground.

Order of start: PostgreSQL (embedded unless a URL is given), S3 (embedded ``weed mini`` unless an
endpoint is given), migrations, a local CA and the server certificate (trainyard/certs.py), the
control plane over HTTPS (``python -m trainyard server --tls-cert ...``; plain HTTP with
``--insecure-http``), one agent per node (``python -m trainyard agent --ca-file ...``, node i at
127.0.0.(i+1) with virtual GPU slots). Stop is the reverse, on Ctrl-C, SIGTERM, or when the
control plane, PostgreSQL or S3 dies (then the exit status is 1). A node agent that dies is
reported and the cluster keeps running (the control plane declares the node lost and recovers its
jobs); ``trainyard dev node kill|kill-workers|restart NODE`` acts on a node of the running cluster
(trainyard/dev_control.py).

Layout of the data dir::

    DIR/postgres/      PGDATA (kept: a second ``dev up`` on DIR reuses the database)
    DIR/s3/            SeaweedFS data; DIR/s3-credentials.json its keys (0600)
    DIR/tls/           ca.pem (give it to clients: curl --cacert), ca-key.pem, server.pem, server-key.pem
    DIR/logs/NAME.log  output of each process (control-plane, node-1, ..., s3)
    DIR/nodes/node-i/  each agent's work dir (and its workers' directories, when every directory
                       above DIR lets other users through; else under the temporary directory)
    DIR/dev-up.lock    held while a ``dev up`` runs on DIR; DIR/dev-up.pids its children
    DIR/admin.token    the admin token (0600): trainyard login URL --token-file DIR/admin.token
    DIR/control/       requests to the running ``dev up`` (trainyard/dev_control.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import ssl
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from trainyard import dev_control
from trainyard.certs import ServerTls, ensure_server_tls
from trainyard.dev.config import (
    DEV_WORKER_UIDS,
    NOT_ISOLATED,
    READY_MARKER,
    SECRET_ENV,
    DevConfig,
    DevError,
    _Interrupted,
)
from trainyard.dev_processes import (
    Child,
    descendants,
    exit_code,
    is_training,
    kill_all,
    kill_leftovers,
    record_pid,
    s3_credentials,
    stop_children,
)
from trainyard.embedded import (
    EmbeddedError,
    EmbeddedPostgres,
    EmbeddedS3,
    has_exited,
    port_is_free,
    signal_group,
)
from trainyard.protocol.s3tls import split_endpoint, tls_context, tls_failure
from trainyard.tls import client_context

__all__ = ["DEV_WORKER_UIDS", "NOT_ISOLATED", "READY_MARKER", "SECRET_ENV", "DevCluster", "DevConfig", "DevError",
           "_PoolCheck", "run_dev_up"]


class _PoolCheck:
    """Whether the agents' worker uid pool works on this machine, found in a thread of its own:
    the agent's own start check (node_agent/isolation.py), run as root, with the agents' cwd. A
    ``dev up`` where it fails (no mount namespaces for a Python in a private /root, say) runs its
    workers unisolated and says so, rather than not starting at all."""

    def __init__(self, uids: str) -> None:
        self._uids = uids
        self._problem: str | None = None
        self._thread = threading.Thread(target=self._run, name="dev-pool-check", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from node_agent.config import default_run_dir
        from node_agent.isolation import Isolation, UidRange

        try:
            Isolation.configure(UidRange.parse(self._uids), default_run_dir(), use_cgroups=False, cwd=os.getcwd())
        except Exception as exc:  # any reason at all: said, and the cluster still starts
            self._problem = f"{type(exc).__name__}: {exc}"

    def problem(self) -> str | None:
        self._thread.join()
        return self._problem


class DevCluster:
    """The processes of one ``dev up``. ``start()`` blocks until the cluster is ready, ``watch()``
    until a stop is requested or something dies, ``stop()`` (idempotent) ends everything."""

    def __init__(self, config: DevConfig, out: IO[str] | None = None) -> None:
        self.config = config
        self.out = out or sys.stdout
        self.token = config.token or secrets.token_urlsafe(24)
        self.logs_dir = config.data_dir / "logs"
        self.pg: EmbeddedPostgres | None = None
        self.s3: EmbeddedS3 | None = None
        self.database_url = config.database_url or ""
        self.tls: ServerTls | None = None
        """The CA and server certificate, once ``start`` made them (None over plain HTTP)."""
        self.control_planes: list[Child | None] = [None] * config.replicas
        self.agents: list[Child] = []
        self._control_plane_env: dict[str, str] = {}
        self._stop_requested = threading.Event()
        self._descendants: dict[tuple[int, float], Any] = {}
        self._stopped = False
        self._reported_dead: set[str] = set()

    # -- lifecycle ----------------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop_requested.set()

    def start(self) -> None:
        cfg = self.config
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        (cfg.data_dir / "nodes").mkdir(parents=True, exist_ok=True)
        kill_leftovers(cfg.data_dir / "dev-up.pids", self._say)
        for port in range(cfg.port, cfg.port + cfg.replicas):
            if not port_is_free(port, cfg.host):
                raise DevError(f"port {port} on {cfg.host} is already in use; choose another with --port")
        # Proven while the databases start (a probe takes about a second), used before the agents.
        pool_check = _PoolCheck(cfg.worker_uids) if cfg.worker_uids else None

        if cfg.database_url is None:
            self._say(f"starting PostgreSQL (data: {cfg.data_dir / 'postgres'})")
            try:
                self.pg = EmbeddedPostgres(cfg.data_dir / "postgres", database="trainyard")
            except EmbeddedError as exc:
                raise DevError(str(exc).splitlines()[0]) from exc
            self.database_url = self.pg.url
        self._check_interrupted()

        s3_endpoint, s3_access, s3_secret = self._start_s3()
        self._check_interrupted()

        self._say("applying database migrations")
        try:
            from control_plane.db import run_migrations
        except ImportError as exc:
            raise DevError(f"the control plane cannot be imported ({exc}); is the package installed?") from exc
        try:
            run_migrations(self.database_url)
        except Exception as exc:
            raise DevError(f"database migrations failed: {' '.join(str(exc).split())[:300]}") from exc
        self._check_interrupted()

        env = {
            "TRAINYARD_DATABASE_URL": self.database_url,
            "TRAINYARD_ADMIN_TOKEN": self.token,
            "TRAINYARD_S3_ENDPOINT": s3_endpoint,
            "TRAINYARD_S3_ACCESS_KEY": s3_access,
            "TRAINYARD_S3_SECRET_KEY": s3_secret,
            "TRAINYARD_S3_BUCKET": cfg.s3_bucket,
            **({"TRAINYARD_S3_CA_FILE": str(cfg.s3_ca_file)} if cfg.s3_ca_file else {}),
            **cfg.control_plane_env,
        }
        self._control_plane_env = env
        if cfg.tls:
            self.tls = ensure_server_tls(cfg.data_dir / "tls", cfg.tls_hosts)
        for i in range(cfg.replicas):
            self._say(f"starting the control plane on {cfg.replica_url(i)}")
            self._start_control_plane(i)

        if pool_check is not None and (problem := pool_check.problem()) is not None:
            self._say(f"{NOT_ISOLATED}: the worker uid pool {cfg.worker_uids} cannot be used on this machine "
                      f"({problem}); every job runs as this user and can read the agents' secrets and "
                      "the other jobs' files")
            cfg.worker_uids = None
        if cfg.worker_uids:
            _own_dir(self._workers_tmp)
        for i in range(1, cfg.nodes + 1):
            self._make_join_token(f"node-{i}")
            self.agents.append(self._spawn(f"node-{i}", self._agent_args(i), {}))
        self._say(f"waiting for {cfg.nodes} node(s) to register")
        self._wait(f"{cfg.nodes} ready node(s)", self._nodes_ready)

    @property
    def control_plane(self) -> Child | None:
        """The first replica's process."""
        return self.control_planes[0]

    def _start_control_plane(self, index: int, extra_env: dict[str, str] | None = None) -> None:
        name = "control-plane" if index == 0 else f"control-plane-{index + 1}"
        port = str(self.config.port + index)
        tls = ["--tls-cert", str(self.tls.cert_file), "--tls-key", str(self.tls.key_file)] if self.tls else []
        self.control_planes[index] = self._spawn(
            name,
            ["-m", "trainyard", "server", "--host", self.config.host, "--port", port, *tls],
            {**self._control_plane_env, **(extra_env or {})},
        )
        url = self.config.replica_url(index)
        self._wait(f"the control plane at {url} to be ready", lambda: self._control_plane_ready(url))

    def restart_control_plane(self, *, replica: int = 0, kill: bool = True, down_s: float = 0.0,
                              extra_env: dict[str, str] | None = None) -> None:
        """Stop a control-plane replica (SIGKILL with ``kill``, else TERM and wait), stay down
        ``down_s``, then start a new one (with ``extra_env`` on top of its settings) and wait until
        it is ready. The agents and their workers are left alone: that is the point."""
        old = self.control_planes[replica]
        if old is not None:
            self._say("killing the control plane" if kill else "stopping the control plane")
            if kill:
                signal_group(old.proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    old.proc.wait(10.0)
                old.log.close()
            else:
                stop_children([old], self.config.stop_grace_s)
            self.control_planes[replica] = None
        self._stop_requested.wait(down_s)
        self._say("starting the control plane again")
        self._start_control_plane(replica, extra_env)

    def _agent_args(self, i: int) -> list[str]:
        cfg = self.config
        name = f"node-{i}"
        args = [
            "-m", "trainyard", "agent",
            "--control-plane", cfg.agent_control_plane.get(name) or cfg.replica_url((i - 1) % cfg.replicas),
            "--join-token-file", str(self.join_token_file(name)),
            "--name", name,
            "--address", f"127.0.0.{i + 1}",
            "--virtual-gpus", str(cfg.gpus_per_node),
            "--work-dir", str(cfg.data_dir / "nodes" / name),
            *(["--ca-file", str(self.tls.ca_file)] if self.tls else []),
        ]  # fmt: skip
        if cfg.worker_uids:
            args += ["--worker-uids", cfg.worker_uids, "--worker-root", str(self._worker_root(name))]
        return args

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
        self.agents[index] = self._spawn(name, self._agent_args(int(name.rsplit("-", 1)[1])), {})
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
        workers = [p for p in descendants(proc.pid) if is_training(p)] if proc.poll() is None else []
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

    def _start_s3(self) -> tuple[str, str, str]:
        cfg = self.config
        if cfg.s3_endpoint is not None:
            assert cfg.s3_access_key and cfg.s3_secret_key
            self._ensure_bucket(cfg.s3_endpoint, cfg.s3_access_key, cfg.s3_secret_key)
            return cfg.s3_endpoint, cfg.s3_access_key, cfg.s3_secret_key
        access, secret = s3_credentials(cfg.data_dir / "s3-credentials.json")
        self._say(f"starting S3 (SeaweedFS; data: {cfg.data_dir / 's3'})")
        try:
            self.s3 = EmbeddedS3(
                cfg.data_dir / "s3",
                access_key=access,
                secret_key=secret,
                bucket=cfg.s3_bucket,
                log_path=self.logs_dir / "s3.log",
            )
        except EmbeddedError as exc:
            raise DevError(f"{str(exc).splitlines()[0]} (log: {self.logs_dir / 's3.log'})") from exc
        return self.s3.endpoint, access, secret

    def _ensure_bucket(self, endpoint: str, access: str, secret: str) -> None:
        import urllib3

        from trainyard.embedded.s3 import S3Endpoint

        host_port, secure = split_endpoint(endpoint)
        # Few retries: an untrusted certificate or a wrong address does not get better with them.
        http = urllib3.PoolManager(retries=urllib3.Retry(total=2, backoff_factor=0.2),
                                   ssl_context=tls_context(str(self.config.s3_ca_file or "")))
        client = S3Endpoint(endpoint=host_port, access_key=access, secret_key=secret,
                            secure=bool(secure)).client(http_client=http)
        try:
            if not client.bucket_exists(self.config.s3_bucket):
                client.make_bucket(self.config.s3_bucket)
        except Exception as exc:
            why = tls_failure(exc, endpoint) or ' '.join(str(exc).split())[:200]
            raise DevError(f"S3 at {endpoint} is not usable: {why}") from exc

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """What an HTTP client of this cluster verifies its certificate with (httpx's ``verify``)."""
        return client_context(self.tls.ca_file) if self.tls else True

    def announce(self) -> None:
        url, token = self.config.api_url, self.token
        token_file = self.config.data_dir / "admin.token"
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        auth = f'-H "Authorization: Bearer {token}"' + (f" --cacert {self.tls.ca_file}" if self.tls else "")
        body = json.dumps(
            {
                "name": "tiny-gpt",
                "num_nodes": min(2, self.config.nodes),
                "gpus_per_node": self.config.gpus_per_node,
                "entrypoint": "worker_runtime.examples.tiny_gpt",
                "args": ["--steps", "300"],
                "checkpoint": {"interval_steps": 50},
                "max_failures": 3,
            }
        )
        lines = [
            "",
            f"Trainyard dev cluster is up: {self.config.nodes} node(s)"
            f" x {self.config.gpus_per_node} virtual GPU slot(s)",
            f"  API:         {url}   (docs: {url}/docs)",
            *([f"  replicas:    {', '.join(self.config.replica_url(i) for i in range(self.config.replicas))}"]
              if self.config.replicas > 1 else []),
            f"  admin token: {token}",
            *([f"  CA:          {self.tls.ca_file}   (the API's certificate is signed by it)"] if self.tls else
              ["  plain HTTP:  --insecure-http; tokens cross the network in the clear"]),
            f"  logs:        {self.logs_dir}",
            "",
            "Try:",
            f"  trainyard login {url} --token-file {token_file}"
            + (f" --ca-file {self.tls.ca_file}" if self.tls else ""),
            "  trainyard run examples/minimal.yaml -f      # docs/writing-jobs.md",
            f"  trainyard dev node kill-workers node-1 --data-dir {self.config.data_dir}",
            f"  curl -s {auth} {url}/v1/nodes",
            f"  curl -s {auth} -H 'Content-Type: application/json' -d '{body}' {url}/v1/jobs",
            f"  curl -s {auth} {url}/v1/jobs/JOB_ID",
            "",
            "Press Ctrl-C to stop.",
            f"{READY_MARKER} url={url} token={token}" + (f" ca={self.tls.ca_file}" if self.tls else ""),
        ]
        print("\n".join(lines), file=self.out, flush=True)

    def watch(self, interval: float = 0.25) -> int:
        """Until a stop is requested (0) or a part of the cluster dies (1)."""
        last_scan = 0.0
        while not self._stop_requested.wait(interval):
            if time.monotonic() - last_scan > 2.0:
                self._scan_descendants()
                last_scan = time.monotonic()
            dev_control.serve_pending(self.config.data_dir, self.node_action)
            for child in self._children():
                if has_exited(child.proc) and child.name not in self._reported_dead:
                    code = exit_code(child.proc)
                    self._say(f"{child.name} exited unexpectedly (code {code}); log: {child.log_path}")
                    self._print_tail(child.log_path)
                    if child not in self.agents:
                        return 1
                    # A dead node is what fault tolerance is for: the control plane declares it lost
                    # and recovers its jobs; the rest of the cluster runs on.
                    self._reported_dead.add(child.name)
                    self._say(f"the cluster keeps running without {child.name}; start it again with "
                              f"'trainyard dev node restart {child.name} --data-dir {self.config.data_dir}'")
            if self.pg is not None and not self.pg.is_running():
                self._say("PostgreSQL stopped unexpectedly; log: " + str(self.pg.data_dir / "log"))
                return 1
            if self.s3 is not None and not self.s3.is_running():
                self._say(f"S3 (weed) stopped unexpectedly; log: {self.s3.log_path}")
                return 1
        return 0

    def stop(self) -> None:
        """Agents first (TERM, KILL after the grace period), then the control plane, S3, Postgres."""
        if self._stopped:
            return
        self._stopped = True
        self._scan_descendants()
        if self.agents:
            self._say("stopping agents")
            stop_children(self.agents, self.config.stop_grace_s)
        running = [cp for cp in self.control_planes if cp is not None]
        if running:
            self._say("stopping the control plane")
            stop_children(running, self.config.stop_grace_s)
        # Whatever a child started and left behind (say, an agent killed before it could stop its
        # workers, which run in sessions of their own) goes too.
        kill_all(list(self._descendants.values()))
        if self.config.worker_uids:
            shutil.rmtree(self._workers_tmp, ignore_errors=True)
        if self.s3 is not None:
            self._say("stopping S3")
            self.s3.stop()
        if self.pg is not None:
            self._say("stopping PostgreSQL")
            self.pg.stop()
        with contextlib.suppress(OSError):
            (self.config.data_dir / "dev-up.pids").unlink()
        self._say("stopped")

    # -- helpers ------------------------------------------------------------------------------------

    def _children(self) -> list[Child]:
        return [*(cp for cp in self.control_planes if cp is not None), *self.agents]

    def _scan_descendants(self) -> None:
        """Remember every process our children started, to end any that outlive them."""
        for child in self._children():
            if not has_exited(child.proc):
                for proc in descendants(child.proc.pid):
                    with contextlib.suppress(Exception):
                        self._descendants[(proc.pid, proc.create_time())] = proc

    def _say(self, message: str) -> None:
        print(f"dev: {message}", file=self.out, flush=True)

    def _print_tail(self, path: Path, lines: int = 15) -> None:
        with contextlib.suppress(OSError):
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            for line in tail:
                print(f"  | {line}", file=sys.stderr)

    def _check_interrupted(self) -> None:
        if self._stop_requested.is_set():
            raise _Interrupted

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        log_path = self.logs_dir / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in _stop_children
        # The user's secrets stay with dev up: each child gets only those given it in `env`.
        inherited = {k: v for k, v in os.environ.items() if k not in SECRET_ENV}
        full_env = {**inherited, **env, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            [self.config.python, *args],
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C at the terminal reaches only us, and we stop the children
            # in order; and stop() can signal each child's whole process group.
            start_new_session=True,
        )
        child = Child(name, proc, log_path, log)
        record_pid(self.config.data_dir / "dev-up.pids", child)
        return child

    def _wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + self.config.ready_timeout_s
        while True:
            self._check_interrupted()
            for child in self._children():
                if has_exited(child.proc):
                    self._print_tail(child.log_path)
                    raise DevError(
                        f"{child.name} exited with code {exit_code(child.proc)} while waiting for {what}; "
                        f"log: {child.log_path}"
                    )
            if ready():
                return
            if time.monotonic() > deadline:
                waited = self.config.ready_timeout_s
                raise DevError(f"timed out after {waited:.0f}s waiting for {what}; logs: {self.logs_dir}")
            self._stop_requested.wait(0.25)

    def _control_plane_ready(self, url: str) -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/readyz", timeout=2.0, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False

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


def run_dev_up(config: DevConfig, out: IO[str] | None = None) -> int:
    """Run a dev cluster until Ctrl-C/SIGTERM (exit status 0) or until a part of it dies (1).

    Raises DevError when it cannot start (after stopping whatever it had started).
    """
    config.data_dir.mkdir(parents=True, exist_ok=True)
    cluster = DevCluster(config, out)
    with _data_dir_lock(config.data_dir), _stop_on_signals(cluster):
        try:
            cluster.start()
            cluster.announce()
            return cluster.watch()
        except _Interrupted:
            return 0
        finally:
            cluster.stop()


@contextlib.contextmanager
def _stop_on_signals(cluster: DevCluster) -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        cluster.request_stop()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _data_dir_lock(data_dir: Path) -> Iterator[None]:
    path = data_dir / "dev-up.lock"
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            raise DevError(f"{data_dir} is in use by another 'trainyard dev up' (pid {owner})") from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fh.truncate(0)


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
