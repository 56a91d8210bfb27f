"""The state the node agent's loops share, and the few helpers every loop uses."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from node_agent.config import AgentConfig
from node_agent.confinement.isolation import Isolation
from node_agent.gpus import GpuSource
from node_agent.link.client import ControlPlaneClient
from node_agent.link.outbox import Outbox
from node_agent.link.relay import Relay
from node_agent.local.api import LocalApi, LocalReports
from node_agent.local.handover import Handovers
from node_agent.loops.wake import SuperviseWakeups
from node_agent.memtier.tier import MemoryTier
from node_agent.part.attempt import AttemptRun
from node_agent.part.code import ShippedCode
from node_agent.part.commands import NodeContext
from node_agent.part.parts import Parts
from node_agent.ranks.orphans import OrphanSweeper
from node_agent.ranks.standby_pool import StandbyPool
from trainyard.protocol.agent import (
    AttemptStatusReport,
    GpuInfo,
    LaunchSpec,
)


@dataclass(frozen=True)
class PendingLaunch:
    """A part to start, with what its launch needs (held while its GPUs are busy)."""

    spec: LaunchSpec
    code: ShippedCode | None
    received: float
    """When its spec arrived (monotonic): its wake-up ends there."""


class AgentCore:
    """What the agent's loops share: set up by Agent.__init__ (node_agent/agent.py), declared here so
    that each loop's module (agent_*.py) is checked against it."""

    config: AgentConfig
    instance: str
    log: Any
    client: ControlPlaneClient
    superseded: str | None
    """Why this agent stopped: another instance registered as this node (409 stale-agent)."""
    epoch: int
    orphans: OrphanSweeper
    reports: LocalReports
    handovers: Handovers
    outbox: Outbox
    relay: Relay
    gpus: list[GpuInfo]
    node_id: str | None
    registered: threading.Event
    isolation: Isolation | None
    _stop_event: threading.Event
    _next_orphan_scan: float
    _gpu_source: GpuSource
    _need_register: threading.Event
    _register_failures: int
    _refused_reports: dict[str, AttemptStatusReport]
    _heartbeat_interval_s: float
    _seq: int
    _runs: dict[str, AttemptRun]
    _known: set[str]
    _pending: dict[str, PendingLaunch]
    _versions: dict[str, str]
    _storage: dict[str, object]
    _runs_lock: threading.Lock
    _reconcile_lock: threading.Lock
    _launched_at: dict[str, float]
    _api: LocalApi | None
    memory_port: int | None
    memory: MemoryTier | None
    _parts: Parts | None
    _node: NodeContext | None
    _standbys: StandbyPool | None
    _supervise_wakeups: SuperviseWakeups | None
    _threads: dict[str, threading.Thread]
    _loops: dict[str, Callable[[], float]]
    _heartbeat_done: threading.Event
    _wakes: dict[str, threading.Event]
    _lifecycle: threading.Lock
    _started: bool
    _stopped: bool

    def runs(self) -> list[AttemptRun]:
        with self._runs_lock:
            return list(self._runs.values())

    def run(self, attempt_id: str) -> AttemptRun | None:
        with self._runs_lock:
            return self._runs.get(attempt_id)

    def _wake(self, *names: str) -> None:
        """Run these loops now rather than at their next period (a local fact changed)."""
        for name in names:
            self._wakes[name].set()

    def _need_register_set(self) -> None:
        self._need_register.set()

    def _stop_or_park(self, run: AttemptRun, reason: str, *, handover_ok: bool | None) -> None:
        """Stop ``run`` as the control plane asked, unless the stop allows a handover (``handover_ok``:
        a restartable job recovering from another node's failure, services/runs/parking.py) and every
        worker of the part runs: then it is parked (node_agent/local/handover.py) for the next attempt to
        take over, and stopped only if none does within handover_timeout_s (the supervise loop).
        ``handover_ok`` None: the answer did not say (a parked part stays parked; any other stops)."""
        if run.parked:
            if handover_ok is False:
                self._unpark(run, f"{reason}; no handover any more")
            return
        if handover_ok and run.parkable() and self.handovers.park(run.attempt_id, self.config.handover_timeout_s):
            run.set_parked(time.time() + self.config.handover_timeout_s)
            run.log.info("attempt_parked", reason=reason, timeout_s=self.config.handover_timeout_s)
            self._wake("report")  # the control plane may hand it over at once
            return
        run.request_stop(reason)
        # Supervision looks at once: a part whose workers are already gone (a failed rank's node)
        # has only torchrun left, which it kills rather than waiting out torchrun's own teardown.
        self._wake("supervise")

    def _unpark(self, run: AttemptRun, reason: str) -> None:
        """Stop a parked part now, unless a takeover already claimed it (node_agent/local/handover.py)."""
        if self.handovers.give_up(run.attempt_id, reason):
            run.set_parked(None)
            run.request_stop(reason)
            self._wake("supervise")
