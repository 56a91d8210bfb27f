"""The node agent: registers the node, runs what the control plane assigns, reports what happens.

Five loops run on their own threads under a monitor (which restarts a loop that died):

- heartbeat (loops/heartbeat.py): (re-)register when needed, send a heartbeat listing the attempts
  with live processes or a final status not yet acknowledged, reconcile against the desired state
  in the answer: launch what is assigned and was never launched here, stop what runs and is no
  longer assigned.
- wait (loops/desired.py): a long poll that learns of a changed desired state at once, and the
  reconciling both loops share.
- supervise (loops/supervise.py): look at local processes and rank files; escalate stops from
  SIGTERM to SIGKILL.
- report (loops/report.py): send each attempt's status when it changes (and every
  status_interval_s), ship new log bytes, and send the final status and last bytes after the end
  until acknowledged. The final status waits until the attempt's queued shards and events are
  delivered: a checkpoint reported just before the exit reaches the control plane before the
  attempt is seen to end.
- relay (loops/report.py): forward the checkpoint shards and events workers post to the local API,
  in order, as soon as they are queued (relay.py).

This module keeps the lifecycle (start, stop, the loops' threads); loops/state.py declares the
state they share.

The loops touch the network only through the client, and every local fact can be recomputed from
the processes and files, so a control-plane outage only delays reports: workers keep running,
status is level-triggered (the latest is resent), logs resume from the acknowledged offsets,
shards and events wait in memory.
The protocol (attempts, fencing, leases) is in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType

import structlog

from node_agent.config import AgentConfig
from node_agent.confinement.isolation import Isolation, IsolationError, private_dir, reachable_by_others
from node_agent.gpus import GpuSource, gpu_source
from node_agent.link.client import ControlPlaneClient
from node_agent.link.outbox import Outbox
from node_agent.link.relay import Relay
from node_agent.link.upload_slots import SlotRelay
from node_agent.local.api import BASE_URL, MAX_SOCKET_PATH, LocalApi, LocalReports
from node_agent.local.handover import Handovers
from node_agent.loops.heartbeat import HeartbeatLoop
from node_agent.loops.report import ReportLoop
from node_agent.loops.state import PendingLaunch
from node_agent.loops.wake import SuperviseWakeups
from node_agent.memtier.peer import PeerServer
from node_agent.memtier.tier import MemoryTier
from node_agent.part.attempt import AttemptRun
from node_agent.part.commands import NodeContext, standby_env
from node_agent.part.parts import Parts
from node_agent.ranks.orphans import OrphanSweeper
from node_agent.ranks.standby_pool import STANDBY_SOCKET_NAME_MAX, StandbyPool, directory_name, remove_stale
from trainyard.protocol.agent import (
    AttemptStatusReport,
    GpuInfo,
)

__all__ = ["Agent", "AgentConfig", "IsolationError", "run_agent"]

log = structlog.get_logger(__name__)

EXIT_SUPERSEDED = 3
"""Exit status of an agent that stopped because another instance registered as its node."""


class Agent(HeartbeatLoop, ReportLoop):
    def __init__(self, config: AgentConfig, *, gpus: GpuSource | None = None) -> None:
        self.config = config
        self.instance = uuid.uuid4().hex
        self.log = log.bind(node=config.name)
        self._stop_event = threading.Event()
        self.client = ControlPlaneClient(
            config.control_plane_url,
            join_token=config.join_token,
            timeout_s=config.http_timeout_s,
            stop=self._stop_event,
            ca_file=str(config.ca_file) if config.ca_file is not None else None,
        )
        self.client.on_stale_agent = self._superseded
        self.superseded: str | None = None
        """Why this agent stopped: another instance registered as this node (409 stale-agent)."""
        self.epoch = 0
        self.orphans = OrphanSweeper(grace_s=config.stop_grace_s, log=self.log)
        self._next_orphan_scan = 0.0
        # A part whose ranks all initialised reports it at once: the recovery's rendezvous phase ends
        # there, and the control plane closes the recovery at the first step (which may come from
        # another node's report within a moment).
        self.reports = LocalReports(on_ready=lambda: self._wake("report"))
        self.handovers = Handovers()
        self.outbox = Outbox(node_max_items=config.outbox_max_items, node_max_bytes=config.outbox_max_bytes)
        self.relay = Relay(
            self.outbox,
            self.client,
            target=self._relay_target,
            on_stale=self._relay_stale,
            on_unauthorized=self._need_register_set,
        )
        self.slots = SlotRelay(self.client, target=self._relay_target, on_stale=self._relay_stale,
                               on_unauthorized=self._need_register_set)
        self._gpu_source = gpus or gpu_source(config.virtual_gpus, config.name)
        self.gpus: list[GpuInfo] = []
        self.node_id: str | None = None
        self.registered = threading.Event()
        self._need_register = threading.Event()
        self._need_register.set()
        self._register_failures = 0
        self._refused_reports: dict[str, AttemptStatusReport] = {}
        """attempt id -> the status report the control plane refused (4xx): not sent again as is."""
        self._heartbeat_interval_s = 1.0
        self._seq = 0
        self._runs: dict[str, AttemptRun] = {}
        self._known: set[str] = set()
        self._pending: dict[str, PendingLaunch] = {}
        """Specs whose GPUs a live part of this node still holds: started once it is gone."""
        # Spec versions this agent holds (reported in each heartbeat, so unchanged specs are not
        # resent) and the storage access of the registration (LaunchSpec.storage has the prefix);
        # never a credential: workers get presigned URLs through _storage_grants.
        self._versions: dict[str, str] = {}
        self._storage: dict[str, object] = {}
        self._runs_lock = threading.Lock()
        # Answers come from two loops (heartbeat, long poll): applied one at a time, and an answer
        # never stops an attempt launched after its request left (_reconcile).
        self._reconcile_lock = threading.Lock()
        self._launched_at: dict[str, float] = {}
        self._api: LocalApi | None = None
        self.memory: MemoryTier | None = None
        """The in-memory checkpoint tier (memtier/tier.py); None when off (memory_tier_mb 0) or its port
        could not be bound."""
        self.memory_port: int | None = None
        self._peer_server: PeerServer | None = None
        self._parts: Parts | None = None
        self.isolation: Isolation | None = None
        self._node: NodeContext | None = None
        self._standbys: StandbyPool | None = None
        self._supervise_wakeups: SuperviseWakeups | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._loops: dict[str, Callable[[], float]] = {
            "heartbeat": self._heartbeat_step,
            "supervise": self._supervise_step,
            "report": self._report_step,
            "relay": self._relay_step,
            "wait": self._wait_step,
        }
        self._heartbeat_done = threading.Event()  # set after each answered heartbeat
        self._wakes = {name: threading.Event() for name in self._loops}
        self._lifecycle = threading.Lock()
        self._started = False
        self._stopped = False

    # --- lifecycle ---

    def local_api_socket(self, attempt_id: str) -> str | None:
        """The local API's socket of one attempt part this agent serves (TRAINYARD_AGENT_SOCKET)."""
        path = None if self._api is None else self._api.socket_of(attempt_id)
        return None if path is None else str(path)

    def start(self) -> None:
        """Discover GPUs, set up isolation, re-adopt attempts left in work_dir (serving their local
        API sockets again), start the loops. Returns at once: registration happens in the
        background, retried until it succeeds. Raises IsolationError when the configured isolation
        cannot be had."""
        with self._lifecycle:
            if self._started or self._stopped:
                return
            self._started = True
        config = self.config
        self.gpus = self._gpu_source.discover()
        self.isolation, notes = Isolation.configure(
            config.worker_uids, config.runtime_dir, use_cgroups=config.cgroups, cwd=os.getcwd(),
            limits=config.limits, gpus=len(self.gpus), work_dir=config.workers_dir,
        )
        for note in notes:
            self.log.info("isolation", detail=note)
        # Workers must get through to their own directory and socket, never into the agent's state.
        private_dir(config.work_dir, 0o711)
        private_dir(config.workers_dir, 0o711)
        self._start_memory_tier()
        self._api = LocalApi(self.reports, self.outbox, grants=self._storage_grants, slots=self.slots,
                             memory=self.memory, handovers=self.handovers)
        self._parts = Parts(config, self._api, self.isolation, self.log)
        if self.isolation.isolated:
            for what, directory in (("--worker-root", config.workers_dir), ("--run-dir", self._parts.sockets_dir)):
                blocked = reachable_by_others(directory)
                if blocked is not None:
                    raise IsolationError(
                        f"worker uids cannot reach {directory}: {blocked} does not let other users through "
                        f"(o+x); choose a {what} every worker uid can reach"
                    )
            self.log.info("workers_isolated", uids=str(config.worker_uids))
        else:
            self.log.warning(
                "workers_not_isolated",
                detail=f"no --worker-uids: every job's code runs as this agent's user (uid {os.geteuid()}), "
                "can read the agent's environment and files and signal other jobs' processes; "
                "configure a worker uid pool (docs/security.md)",
            )
        self._node = NodeContext(
            local_addr=config.address,
            agent_url=BASE_URL,
            virtual=self._gpu_source.virtual,
            join_timeout_s=config.rdzv_join_timeout_s,
            shutdown_timeout_s=math.ceil(config.stop_grace_s),
            node_name=config.name,
            env_passthrough=config.worker_env_passthrough,
            allowed_pythons=tuple(str(p) for p in config.allowed_pythons),
        )
        if config.standbys:
            self._standbys = self._standby_pool(self._node)
            self._node = dataclasses.replace(self._node, standby_dir=str(self._standbys.directory))
        self._adopt_existing()
        self._supervise_wakeups = SuperviseWakeups(lambda: self._wake("supervise"))
        if self.config.control_plane_url.startswith("http://"):
            self.log.warning("control_plane_not_https", url=self.config.control_plane_url,
                             risk="the join token and node credentials cross the network unencrypted")
        self.log.info("agent_started", gpus=len(self.gpus), instance=self.instance)
        for name in self._loops:
            self._start_loop(name)
        self._threads["monitor"] = threading.Thread(target=self._monitor, name="agent-monitor", daemon=True)
        self._threads["monitor"].start()

    def _standby_pool(self, node: NodeContext) -> StandbyPool:
        """The warm standbys of ``--standbys`` (node_agent/ranks/standby.py). Without cgroups or a uid pool
        the agent finds an attempt's processes by the variables they started with, which a standby
        (started before the attempt) does not have: refused, rather than workers it cannot see."""
        assert self.isolation is not None
        if self.isolation.cgroups is None and self.isolation.pool is None:
            raise IsolationError(
                "--standbys needs workers tracked by cgroup v2 or by uid (--worker-uids): without either the "
                "agent could not find the processes of an attempt whose ranks run in standbys"
            )
        parent = private_dir(self.config.runtime_dir / "standby", 0o711)
        remove_stale(parent)
        directory = parent / directory_name(self.config.name, os.getpid())
        longest = len(os.fsencode(str(directory))) + STANDBY_SOCKET_NAME_MAX
        if longest > MAX_SOCKET_PATH:
            # A standby could not bind its socket: it would die at once and the pool turn itself off.
            raise IsolationError(f"standby sockets under {directory} would be up to {longest} bytes, over the "
                                 f"{MAX_SOCKET_PATH} a unix socket path may have: use a shorter --run-dir")
        if self.isolation.isolated and reachable_by_others(directory.parent) is not None:
            raise IsolationError(f"worker uids cannot reach {directory}: choose a --run-dir every worker uid can reach")
        pool = StandbyPool(
            size=self.config.standbys, directory=directory, python=node.python, env=standby_env(node), cwd="/",
            uids=self.config.worker_uids, cgroup_base=self.isolation.cgroups.base if self.isolation.cgroups else None,
            log=self.log,
        )
        self.log.info("standbys", count=pool.size, directory=str(directory))
        return pool

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loops, then (unless keep_workers_on_exit) the workers: SIGTERM, SIGKILL after
        stop_grace_s, SIGKILL for everything left at `timeout`. Tells the control plane nothing:
        it learns from the missing heartbeats. Idempotent."""
        with self._lifecycle:
            if self._stopped:
                return
            self._stopped = True
        deadline = time.monotonic() + (self.config.stop_grace_s + 10.0 if timeout is None else timeout)
        with self._runs_lock:  # after this, the heartbeat loop launches nothing more
            self._stop_event.set()
        self._wake(*self._loops)
        self.outbox.wake()
        for thread in self._threads.values():
            # An in-flight request may hold a loop for up to http_timeout_s; its thread is a daemon.
            thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
        if not self.config.keep_workers_on_exit or self.superseded is not None:
            # A superseded agent's workers belong to no one the control plane trusts: stop them.
            self._stop_all_workers(deadline)
        lost = self.outbox.close()  # releases workers waiting on a shard
        if lost:
            self.log.warning("outbox_items_lost_at_shutdown", items=lost)
        if self._api is not None:
            self._api.stop()
        if self._supervise_wakeups is not None:
            self._supervise_wakeups.close()
        if self._standbys is not None:
            self._standbys.close()  # the idle ones; those ranks took are their attempts' processes
        if self._peer_server is not None:
            self._peer_server.stop()
        if self.memory is not None:
            self.memory.stop()
        for run in self.runs():
            if run.confinement.lease is not None:
                run.confinement.lease.close()  # as at exit: the next instance claims the uids of what it adopts
        self.client.close()
        self.log.info("agent_stopped")

    def _start_memory_tier(self) -> None:
        """Serve the in-memory checkpoint tier to peers at address:memory_port. A port that cannot be
        bound leaves the tier off (logged): it only ever makes restores faster."""
        config = self.config
        if config.memory_tier_mb <= 0:
            return
        tls = config.memory_tls_context()
        if tls is None and not config.memory_plain_http:
            self.log.error("memory_tier_off", reason="no --memory-tls-cert for the memory port (shards never cross the "
                           "network in clear by default); pass --memory-plain-http to serve it without TLS on a "
                           "trusted network")
            return
        if tls is None:
            self.log.warning("memory_tier_plain_http", risk="checkpoint shards and the jobs' grants cross the network "
                             "unencrypted (--memory-plain-http)")
        tier = MemoryTier(config.memory_tier_mb * 2**20, peer_tls=config.peer_client_context(),
                          require_tls=tls is not None)
        try:
            self._peer_server = PeerServer(tier, config.address, config.memory_port, tls=tls).start()
        except OSError as exc:
            self.log.error("memory_tier_off", reason=f"cannot serve peers at {config.address}:{config.memory_port}: "
                           f"{exc}")
            return
        self.memory, self.memory_port = tier, self._peer_server.port
        self.log.info("memory_tier_on", budget_mb=config.memory_tier_mb, port=self.memory_port, tls=tls is not None)

    def _superseded(self, exc: Exception) -> None:
        """Another agent instance registered as this node: the newer one wins. Stop launching, stop
        the workers and exit; never register again (two agents would take the node in turns)."""
        with self._lifecycle:
            if self.superseded is not None or self._stopped:
                return
            self.superseded = str(exc)
        self.log.error("agent_superseded_stopping", reason=str(exc), instance=self.instance, epoch=self.epoch)
        with self._runs_lock:
            self._stop_event.set()  # nothing more is launched
        threading.Thread(target=self.stop, name="agent-superseded-stop", daemon=True).start()

    def _start_loop(self, name: str) -> None:
        thread = threading.Thread(target=self._run_loop, args=(name,), name=f"agent-{name}", daemon=True)
        self._threads[name] = thread
        thread.start()

    def _run_loop(self, name: str) -> None:
        step = self._loops[name]
        failures = 0
        while not self._stop_event.is_set():
            try:
                wait = step()
                failures = 0
            except Exception:
                failures += 1
                self.log.exception("loop_failed", loop=name, failures=failures)
                wait = min(30.0, 0.5 * 2 ** min(failures, 6))
            wake = self._wakes[name]
            wake.wait(wait)  # stop() sets every wake event too
            wake.clear()

    def _monitor(self) -> None:
        while not self._stop_event.wait(1.0):
            for name in self._loops:
                if not self._threads[name].is_alive() and not self._stop_event.is_set():
                    self.log.error("loop_died_restarting", loop=name)
                    self._start_loop(name)

    # --- supervise loop ---

    # --- relay loop ---





def run_agent(config: AgentConfig) -> None:
    """Run an agent until SIGINT or SIGTERM, then stop it gracefully. Call from the main thread."""
    agent = Agent(config)
    received = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        agent.log.info("signal_received", signal=signal.Signals(signum).name)
        received.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        agent.start()
        while not received.wait(1.0) and agent.superseded is None:
            pass
    finally:
        agent.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if agent.superseded is not None:
        raise SystemExit(EXIT_SUPERSEDED)
