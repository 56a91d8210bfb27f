"""The state the node agent's loops share (``AgentState``), and what every loop may do with it.

One object, made by ``Agent.__init__`` (node_agent/agent.py) and handed to each loop, which keeps
nothing else shared: a loop's own bookkeeping (the heartbeat's sequence number, the supervisor's
next orphan scan) stays in the loop. What the agent only learns at start (its isolation, local API,
parts, node context, standbys, memory tier) is None until then.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from node_agent.config import AgentConfig
from node_agent.confinement.isolation import Isolation
from node_agent.gpus import GpuSource
from node_agent.link.client import ControlPlaneClient, StaleAttempt
from node_agent.link.outbox import Outbox
from node_agent.local.api import LocalApi, LocalReports
from node_agent.local.handover import Handovers
from node_agent.loops.wake import SuperviseWakeups
from node_agent.memtier.tier import MemoryTier
from node_agent.part.attempt import Part
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

LOOPS = ("heartbeat", "wait", "supervise", "report", "relay")
"""The agent's loops, each on a thread of its own (node_agent/agent.py)."""

STALE_PARKED_GRACE_S = 5.0
"""How long a parked part whose attempt turned stale waits for the spec that takes it over (with two
heartbeat intervals more: the long poll brings it within milliseconds, a heartbeat within one)."""


@dataclass(frozen=True)
class PendingLaunch:
    """A part to start, with what its launch needs (held while its GPUs are busy)."""

    spec: LaunchSpec
    code: ShippedCode | None
    received: float
    """When its spec arrived (monotonic): its wake-up ends there."""


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


@dataclass(eq=False, kw_only=True)
class AgentState:
    """What the agent's loops share."""

    config: AgentConfig
    instance: str
    """This agent process's id, sent at registration and with every heartbeat."""
    log: Any
    client: ControlPlaneClient
    gpu_source: GpuSource
    outbox: Outbox
    reports: LocalReports
    handovers: Handovers
    orphans: OrphanSweeper
    stop_event: threading.Event
    """Set once the agent stops: the loops end, and nothing more is launched."""
    wakes: dict[str, threading.Event] = field(default_factory=lambda: {name: threading.Event() for name in LOOPS})
    """One per loop (LOOPS): set, the loop runs now rather than at its next period."""

    # Registration.
    registered: threading.Event = field(default_factory=threading.Event)
    need_register: threading.Event = field(default_factory=_set_event)
    superseded: str | None = None
    """Why this agent stopped: another instance registered as this node (409 stale-agent)."""
    node_id: str | None = None
    epoch: int = 0
    heartbeat_interval_s: float = 1.0
    heartbeat_done: threading.Event = field(default_factory=threading.Event)
    """Set after each answered heartbeat."""
    storage: dict[str, object] = field(default_factory=dict)
    """The storage access of the registration (LaunchSpec.storage has the prefix); never a
    credential: workers get presigned URLs through the relay loop's storage_grants."""
    gpus: list[GpuInfo] = field(default_factory=list)

    # The parts, under runs_lock.
    runs_lock: threading.Lock = field(default_factory=threading.Lock)
    by_id: dict[str, Part] = field(default_factory=dict)
    """This agent's parts by attempt id: launched, taken over or adopted, until they are done."""
    known: set[str] = field(default_factory=set)
    """Every attempt this agent instance launched or found: never launched (again) by it."""
    pending: dict[str, PendingLaunch] = field(default_factory=dict)
    """Specs whose GPUs a live part of this node still holds: started once it is gone."""

    # The desired state, under reconcile_lock: answers come from two loops (heartbeat, long poll),
    # applied one at a time, and an answer never stops an attempt launched after its request left.
    reconcile_lock: threading.Lock = field(default_factory=threading.Lock)
    versions: dict[str, str] = field(default_factory=dict)
    """Spec versions this agent holds (reported in each heartbeat, so unchanged specs are not resent)."""
    launched_at: dict[str, float] = field(default_factory=dict)
    refused_reports: dict[str, AttemptStatusReport] = field(default_factory=dict)
    """attempt id -> the status report the control plane refused (4xx): not sent again as is."""

    # Set up by Agent.start.
    isolation: Isolation | None = None
    api: LocalApi | None = None
    parts: Parts | None = None
    node: NodeContext | None = None
    standbys: StandbyPool | None = None
    supervise_wakeups: SuperviseWakeups | None = None
    memory: MemoryTier | None = None
    """The in-memory checkpoint tier (memtier/tier.py); None when off (memory_tier_mb 0) or its port
    could not be bound."""
    memory_port: int | None = None

    def runs(self) -> list[Part]:
        with self.runs_lock:
            return list(self.by_id.values())

    def run(self, attempt_id: str) -> Part | None:
        with self.runs_lock:
            return self.by_id.get(attempt_id)

    def wake(self, *names: str) -> None:
        """Run these loops now rather than at their next period (a local fact changed)."""
        for name in names:
            self.wakes[name].set()

    def stop_or_park(self, run: Part, reason: str, *, handover_ok: bool | None) -> None:
        """Stop ``run`` as the control plane asked, unless the stop allows a handover (``handover_ok``:
        a restartable job recovering from another node's failure, services/runs/parking.py) and every
        worker of the part runs: then it is parked (node_agent/local/handover.py) for the next attempt to
        take over, and stopped only if none does within handover_timeout_s (the supervise loop).
        ``handover_ok`` None: the answer did not say (a parked part stays parked; any other stops)."""
        if run.parked:
            if handover_ok is False:
                self.unpark(run, f"{reason}; no handover any more")
            return
        if handover_ok and run.parkable() and self.handovers.park(run.attempt_id, self.config.handover_timeout_s):
            run.set_parked(time.time() + self.config.handover_timeout_s)
            run.log.info("attempt_parked", reason=reason, timeout_s=self.config.handover_timeout_s)
            self.wake("report")  # the control plane may hand it over at once
            return
        run.request_stop(reason)
        # Supervision looks at once: a part whose workers are already gone (a failed rank's node)
        # has only torchrun left, which it kills rather than waiting out torchrun's own teardown.
        self.wake("supervise")

    def unpark(self, run: Part, reason: str) -> None:
        """Stop a parked part now, unless a takeover already claimed it (node_agent/local/handover.py)."""
        if self.handovers.give_up(run.attempt_id, reason):
            run.set_parked(None)
            run.request_stop(reason)
            self.wake("supervise")

    def fence_off(self, run: Part, exc: StaleAttempt) -> None:
        """The control plane refused a report about ``run`` as stale: its attempt is over for this
        node. Its queued items are dropped and it is stopped (a parked one waits a little for the
        takeover that may be on its way)."""
        run.log.warning("attempt_stale", error=str(exc))
        run.stale = True
        self.reports.unregister(run.attempt_id)
        self.refused_reports.pop(run.attempt_id, None)
        dropped = self.outbox.drop(run.attempt_id, HTTPStatus.CONFLICT, f"stale attempt: {exc}")
        if dropped:
            run.log.warning("outbox_dropped_stale", items=dropped)
        if run.parked and self.handovers.parked(run.attempt_id):
            # The job's next attempt exists. It took this part over (its spec may reach this agent a
            # moment after this answer: stopping now would kill the workers just handed over), or it
            # runs elsewhere: then the handover timeout, cut short here, stops the part.
            self.handovers.shorten(run.attempt_id, STALE_PARKED_GRACE_S + 2 * self.heartbeat_interval_s)
            self.wake("heartbeat")
            return
        run.request_stop("stale: the control plane fenced this attempt off")
        self.wake("supervise")
