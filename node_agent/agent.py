"""The node agent: registers the node, runs what the control plane assigns, reports what happens.

``Agent`` composes one state (``AgentState``, loops/state.py: what the loops share) and five loops,
each an object over that state with one entry point (``step``: one pass, returning the seconds until
the next), run on threads of their own under a monitor (which restarts a loop that died):

- heartbeat (``HeartbeatLoop``, loops/heartbeat.py): (re-)register when needed, send a heartbeat
  listing the attempts with live processes or a final status not yet acknowledged, and apply the
  desired state in the answer.
- wait (``DesiredState``, loops/desired.py): a long poll that learns of a changed desired state at
  once; and applying an answer (``reconcile``, the heartbeat's too): launch what is assigned and was
  never launched here, stop what runs and is no longer assigned.
- supervise (``SuperviseLoop``, loops/supervise.py): look at local processes and rank files;
  escalate stops from SIGTERM to SIGKILL; sweep orphans; start parts held while their GPUs were busy.
- report (``ReportLoop``, loops/report.py): send each attempt's status when it changes (and every
  status_interval_s), ship new log bytes, and send the final status and last bytes after the end
  until acknowledged. The final status waits until the attempt's queued shards and events are
  delivered: a checkpoint reported just before the exit reaches the control plane before the
  attempt is seen to end.
- relay (``RelayLoop``, loops/report.py): forward the checkpoint shards and events workers post to
  the local API, in order, as soon as they are queued (link/relay.py).

What one loop needs of another is handed to it when the agent is built (the heartbeat gets the
desired state and the supervisor's orphan sweep, the supervisor the desired state's pending
launches), never found through inheritance. This module keeps the lifecycle (start, stop, the loops'
threads).

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
from typing import Any

import structlog

from node_agent.config import MAX_STANDBYS, AgentConfig
from node_agent.confinement.isolation import Isolation, IsolationError, private_dir, reachable_by_others
from node_agent.gpus import GpuSource, gpu_source
from node_agent.link.client import ControlPlaneClient
from node_agent.link.outbox import Outbox
from node_agent.local.api import BASE_URL, MAX_SOCKET_PATH, LocalApi, LocalReports
from node_agent.local.handover import Handovers
from node_agent.loops.desired import DesiredState
from node_agent.loops.heartbeat import HeartbeatLoop
from node_agent.loops.report import RelayLoop, ReportLoop
from node_agent.loops.state import LOOPS, AgentState
from node_agent.loops.supervise import SuperviseLoop
from node_agent.loops.wake import SuperviseWakeups
from node_agent.memtier.peer import PeerServer
from node_agent.memtier.tier import MemoryTier
from node_agent.part.attempt import Part
from node_agent.part.commands import NodeContext, standby_env
from node_agent.part.parts import Parts
from node_agent.ranks.orphans import OrphanSweeper
from node_agent.ranks.standby_pool import STANDBY_SOCKET_NAME_MAX, StandbyPool, directory_name, remove_stale

__all__ = ["Agent", "AgentConfig", "IsolationError", "run_agent"]

log = structlog.get_logger(__name__)

EXIT_SUPERSEDED = 3
"""Exit status of an agent that stopped because another instance registered as its node."""


class Agent:
    """One node's agent: its state (``state``, loops/state.py) and its loops, each an object with one
    entry point (``step``), composed here and run on threads of their own under a monitor."""

    def __init__(self, config: AgentConfig, *, gpus: GpuSource | None = None) -> None:
        stop = threading.Event()
        client = ControlPlaneClient(
            config.control_plane_url,
            join_token=config.join_token,
            timeout_s=config.http_timeout_s,
            stop=stop,
            ca_file=str(config.ca_file) if config.ca_file is not None else None,
        )
        client.on_stale_agent = self._superseded
        node_log = log.bind(node=config.name)
        self.state = state = AgentState(
            config=config,
            instance=uuid.uuid4().hex,
            log=node_log,
            client=client,
            gpu_source=gpus or gpu_source(config.virtual_gpus, config.name),
            outbox=Outbox(node_max_items=config.outbox_max_items, node_max_bytes=config.outbox_max_bytes),
            # A part whose ranks all initialised reports it at once: the recovery's rendezvous phase
            # ends there, and the control plane closes the recovery at the first step (which may
            # come from another node's report within a moment).
            reports=LocalReports(on_ready=lambda: state.wake("report")),
            handovers=Handovers(),
            orphans=OrphanSweeper(grace_s=config.stop_grace_s, log=node_log),
            stop_event=stop,
        )
        self.desired = DesiredState(state)
        self.supervision = SuperviseLoop(state, launch_pending=self.desired.launch_pending)
        self.heartbeat = HeartbeatLoop(state, self.desired, sweep_orphans=self.supervision.sweep_orphans)
        self.reporting = ReportLoop(state)
        self.relaying = RelayLoop(state)
        self._loops: dict[str, Callable[[], float]] = {
            "heartbeat": self.heartbeat.step,
            "wait": self.desired.step,
            "supervise": self.supervision.step,
            "report": self.reporting.step,
            "relay": self.relaying.step,
        }
        assert set(self._loops) == set(LOOPS) == set(state.wakes)
        self._peer_server: PeerServer | None = None
        self._threads: dict[str, threading.Thread] = {}
        self._lifecycle = threading.Lock()
        self._started = False
        self._stopped = False

    @property
    def config(self) -> AgentConfig:
        return self.state.config

    @property
    def log(self) -> Any:
        return self.state.log

    @property
    def superseded(self) -> str | None:
        """Why this agent stopped: another instance registered as this node (409 stale-agent)."""
        return self.state.superseded

    def runs(self) -> list[Part]:
        return self.state.runs()

    def run(self, attempt_id: str) -> Part | None:
        return self.state.run(attempt_id)

    # --- lifecycle ---

    def local_api_socket(self, attempt_id: str) -> str | None:
        """The local API's socket of one attempt part this agent serves (TRAINYARD_AGENT_SOCKET)."""
        state = self.state
        path = None if state.api is None else state.api.socket_of(attempt_id)
        return None if path is None else str(path)

    def start(self) -> None:
        """Discover GPUs, set up isolation, re-adopt attempts left in work_dir (serving their local
        API sockets again), start the loops. Returns at once: registration happens in the
        background, retried until it succeeds. Raises IsolationError when the configured isolation
        cannot be had."""
        state = self.state
        with self._lifecycle:
            if self._started or self._stopped:
                return
            self._started = True
        config = self.config
        state.gpus = state.gpu_source.discover()
        state.isolation, notes = Isolation.configure(
            config.worker_uids, config.runtime_dir, use_cgroups=config.cgroups, cwd=os.getcwd(),
            limits=config.limits, gpus=len(state.gpus), work_dir=config.workers_dir,
        )
        for note in notes:
            self.log.info("isolation", detail=note)
        # Workers must get through to their own directory and socket, never into the agent's state.
        private_dir(config.work_dir, 0o711)
        private_dir(config.workers_dir, 0o711)
        self._start_memory_tier()
        state.api = LocalApi(state.reports, state.outbox, grants=self.relaying.storage_grants,
                             slots=self.relaying.slots, memory=state.memory, handovers=state.handovers)
        state.parts = Parts(config, state.api, state.isolation, self.log)
        if state.isolation.isolated:
            for what, directory in (("--worker-root", config.workers_dir), ("--run-dir", state.parts.sockets_dir)):
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
        state.node = NodeContext(
            local_addr=config.address,
            agent_url=BASE_URL,
            virtual=state.gpu_source.virtual,
            join_timeout_s=config.rdzv_join_timeout_s,
            shutdown_timeout_s=math.ceil(config.stop_grace_s),
            node_name=config.name,
            env_passthrough=config.worker_env_passthrough,
            allowed_pythons=tuple(str(p) for p in config.allowed_pythons),
        )
        standbys = self._standby_count()
        if standbys:
            try:
                state.standbys = self._standby_pool(state.node, standbys)
            except IsolationError as exc:
                if config.standbys is not None:
                    raise  # asked for by number: refused, as before
                self.log.info("standbys_off", reason=str(exc))  # auto: none rather than no agent
            else:
                state.node = dataclasses.replace(state.node, standby_dir=str(state.standbys.directory))
        self.supervision.adopt_existing()
        state.supervise_wakeups = SuperviseWakeups(lambda: state.wake("supervise"))
        if self.config.control_plane_url.startswith("http://"):
            self.log.warning("control_plane_not_https", url=self.config.control_plane_url,
                             risk="the join token and node credentials cross the network unencrypted")
        self.log.info("agent_started", gpus=len(state.gpus), instance=state.instance)
        for name in self._loops:
            self._start_loop(name)
        self._threads["monitor"] = threading.Thread(target=self._monitor, name="agent-monitor", daemon=True)
        self._threads["monitor"].start()

    def _standby_count(self) -> int:
        """``--standbys``, or for ``auto`` one per GPU and one for torchrun (each new attempt's part
        takes that many) where the agent tracks workers by cgroup or uid, else none (said in the log)."""
        state = self.state
        if self.config.standbys is not None:
            return self.config.standbys
        assert state.isolation is not None
        if state.isolation.cgroups is None and state.isolation.pool is None:
            self.log.info("standbys_off", reason="workers are tracked neither by cgroup v2 nor by uid (--worker-uids)")
            return 0
        return min(MAX_STANDBYS, len(state.gpus) + 1)

    def _standby_pool(self, node: NodeContext, size: int) -> StandbyPool:
        """The warm standbys of ``--standbys`` (node_agent/ranks/standby.py). Without cgroups or a uid pool
        the agent finds an attempt's processes by the variables they started with, which a standby
        (started before the attempt) does not have: refused, rather than workers it cannot see."""
        state = self.state
        assert state.isolation is not None
        if state.isolation.cgroups is None and state.isolation.pool is None:
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
        if state.isolation.isolated and reachable_by_others(directory.parent) is not None:
            raise IsolationError(f"worker uids cannot reach {directory}: choose a --run-dir every worker uid can reach")
        pool = StandbyPool(
            size=size, directory=directory, python=node.python, env=standby_env(node), cwd="/",
            uids=self.config.worker_uids, cgroup_base=state.isolation.cgroups.base if state.isolation.cgroups else None,
            log=self.log,
        )
        self.log.info("standbys", count=pool.size, directory=str(directory))
        return pool

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loops, then (unless keep_workers_on_exit) the workers: SIGTERM, SIGKILL after
        stop_grace_s, SIGKILL for everything left at `timeout`. Tells the control plane nothing:
        it learns from the missing heartbeats. Idempotent."""
        state = self.state
        with self._lifecycle:
            if self._stopped:
                return
            self._stopped = True
        deadline = time.monotonic() + (self.config.stop_grace_s + 10.0 if timeout is None else timeout)
        with state.runs_lock:  # after this, the heartbeat loop launches nothing more
            state.stop_event.set()
        state.wake(*self._loops)
        state.outbox.wake()
        for name, thread in self._threads.items():
            if name == "wait":
                # Its long poll stays open until the control plane answers, and whatever the answer,
                # the loop launches nothing once stop_event is set (DesiredState.reconcile): not
                # waited for (a daemon), which took a second of every agent's stop.
                continue
            # An in-flight request may hold a loop for up to http_timeout_s; its thread is a daemon.
            thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
        if not self.config.keep_workers_on_exit or state.superseded is not None:
            # A superseded agent's workers belong to no one the control plane trusts: stop them.
            self.supervision.stop_all_workers(deadline)
        lost = state.outbox.close()  # releases workers waiting on a shard
        self.relaying.slots.close()  # its held releases: their leases expire (the agent is going)
        if lost:
            self.log.warning("outbox_items_lost_at_shutdown", items=lost)
        if state.api is not None:
            state.api.stop()
        if state.supervise_wakeups is not None:
            state.supervise_wakeups.close()
        if state.standbys is not None:
            state.standbys.close()  # the idle ones; those ranks took are their attempts' processes
        if self._peer_server is not None:
            self._peer_server.stop()
        if state.memory is not None:
            state.memory.stop()
        for run in state.runs():
            if run.confinement.lease is not None:
                run.confinement.lease.close()  # as at exit: the next instance claims the uids of what it adopts
        state.client.close()
        self.log.info("agent_stopped")

    def _start_memory_tier(self) -> None:
        """Serve the in-memory checkpoint tier to peers at address:memory_port. A port that cannot be
        bound leaves the tier off (logged): it only ever makes restores faster."""
        state = self.state
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
        state.memory, state.memory_port = tier, self._peer_server.port
        self.log.info("memory_tier_on", budget_mb=config.memory_tier_mb, port=state.memory_port, tls=tls is not None)

    def _superseded(self, exc: Exception) -> None:
        """Another agent instance registered as this node: the newer one wins. Stop launching, stop
        the workers and exit; never register again (two agents would take the node in turns)."""
        state = self.state
        with self._lifecycle:
            if state.superseded is not None or self._stopped:
                return
            state.superseded = str(exc)
        self.log.error("agent_superseded_stopping", reason=str(exc), instance=state.instance, epoch=state.epoch)
        with state.runs_lock:
            state.stop_event.set()  # nothing more is launched
        threading.Thread(target=self.stop, name="agent-superseded-stop", daemon=True).start()

    def _start_loop(self, name: str) -> None:
        thread = threading.Thread(target=self._run_loop, args=(name,), name=f"agent-{name}", daemon=True)
        self._threads[name] = thread
        thread.start()

    def _run_loop(self, name: str) -> None:
        state = self.state
        step = self._loops[name]
        failures = 0
        while not state.stop_event.is_set():
            try:
                wait = step()
                failures = 0
            except Exception:
                failures += 1
                self.log.exception("loop_failed", loop=name, failures=failures)
                wait = min(30.0, 0.5 * 2 ** min(failures, 6))
            wake = state.wakes[name]
            wake.wait(wait)  # stop() sets every wake event too
            wake.clear()

    def _monitor(self) -> None:
        state = self.state
        while not state.stop_event.wait(1.0):
            for name in self._loops:
                if not self._threads[name].is_alive() and not state.stop_event.is_set():
                    self.log.error("loop_died_restarting", loop=name)
                    self._start_loop(name)


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
