"""DevCluster: the whole ``dev up`` in order (services, migrations, TLS, control-plane replicas,
agents), watched until a stop is asked or a part dies, and stopped in reverse."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time

from trainyard.dev import control as dev_control
from trainyard.dev.certs import ensure_server_tls
from trainyard.dev.config import NOT_ISOLATED, READY_MARKER, DevError
from trainyard.dev.netns import NetnsError, Network, Shape
from trainyard.dev.nodes import NodeAgents, _own_dir, _PoolCheck
from trainyard.dev.processes import Child, exit_code, kill_all, kill_leftovers, stop_children
from trainyard.dev.services import EmbeddedServices
from trainyard.embedded import has_exited, port_is_free, signal_group


class DevCluster(EmbeddedServices, NodeAgents):
    """The processes of one ``dev up``. ``start()`` blocks until the cluster is ready, ``watch()``
    until a stop is requested or something dies, ``stop()`` (idempotent) ends everything."""

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        (cfg.data_dir / "nodes").mkdir(parents=True, exist_ok=True)
        kill_leftovers(cfg.data_dir / "dev-up.pids", self._say)
        if cfg.network is not None:
            self._say(f"building the nodes' network: {cfg.nodes} namespace(s) in {cfg.network.racks} rack(s)")
            try:
                self.network = Network.up(cfg.nodes, cfg.network)
            except NetnsError as exc:
                raise DevError(str(exc)) from exc
            cfg.host = self.network.layout.host_address  # what the nodes reach: the API and S3 listen there
        for port in range(cfg.port, cfg.port + cfg.replicas):
            if not port_is_free(port, cfg.host):
                raise DevError(f"port {port} on {cfg.host} is already in use; choose another with --port")
        # Proven while the databases start (a probe takes about a second), used before the agents.
        pool_check = _PoolCheck(cfg.worker_uids) if cfg.worker_uids else None

        if cfg.database_url is None:
            self._start_postgres()
        self._check_interrupted()

        s3_endpoint, s3_access, s3_secret = self._start_s3()
        self._check_interrupted()

        self._migrate()
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
            self.agents.append(self._spawn_agent(i))
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
            *self._network_lines(),
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

    def _network_lines(self) -> list[str]:
        """--netns: where each node is, and its links' limits."""
        if self.network is None:
            return []
        lay, top = self.network.layout, self.network.layout.topology

        def shape(link: Shape) -> str:
            rate = f"{link.rate_bits / 1e9:g} Gbit/s" if link.rate_bits else "unshaped"
            return rate + (f", {link.delay_ms:g} ms" if link.delay_ms else "")
        lines = [f"  network:     namespaces {lay.prefix}-n1..{lay.nodes}, host side {lay.host_address} "
                 f"(node links {shape(top.node_link)}; rack uplinks {shape(top.rack_uplink)})"]
        lines += [f"               node-{i}  {lay.node_address(i)}  rack r{lay.rack_of(i)}  "
                  f"(run in it: {' '.join(self.network.exec_prefix(i))} CMD)" for i in range(1, lay.nodes + 1)]
        return lines

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
        # S3 and PostgreSQL have no client left: stopped side by side.
        servers = [(name, server) for name, server in (("S3", self.s3), ("PostgreSQL", self.pg)) if server is not None]
        if servers:
            self._say(f"stopping {' and '.join(name for name, _ in servers)}")
            stoppers = [threading.Thread(target=server.stop) for _, server in servers]
            for thread in stoppers:
                thread.start()
            for thread in stoppers:
                thread.join()
        if self.network is not None:
            self._say("removing the nodes' network")
            self.network.down()
        with contextlib.suppress(OSError):
            (self.config.data_dir / "dev-up.pids").unlink()
        self._say("stopped")

    def _control_plane_ready(self, url: str) -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/readyz", timeout=2.0, verify=self.verify).status_code == 200
        except httpx.HTTPError:
            return False
