"""The agent's heartbeat loop: (re-)register when needed, send a heartbeat listing the attempts
with live processes or a final status not yet acknowledged, and apply the desired state in the
answer (loops/desired.py)."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable

import structlog

from node_agent.confinement import processes
from node_agent.link import credential
from node_agent.link.client import (
    ControlPlaneUnavailable,
    RequestRejected,
    StaleAttempt,
    TlsMismatch,
    Unauthorized,
)
from node_agent.loops.desired import HEARTBEAT_JITTER, DesiredState
from node_agent.loops.state import AgentState
from trainyard.protocol.agent import (
    HeartbeatRequest,
    LocalAttempt,
    RegisterRequest,
    agent_request_timeout_s,
)
from trainyard.protocol.memtier import memory_grant_key

log = structlog.get_logger("node_agent.agent")

AGENT_VERSION = "0.1.0"
RETRY_AFTER_FAILURE_S = 5.0
"""The longest pause before a failed heartbeat is tried again, whatever the interval."""


class HeartbeatLoop:
    def __init__(self, state: AgentState, desired: DesiredState, *,
                 sweep_orphans: Callable[[processes.ProcessTable], None]) -> None:
        self.state = state
        self.desired = desired
        """Applies the desired state each answer carries."""
        self.sweep_orphans = sweep_orphans
        """Stops the node's orphaned processes (the supervise loop's): after each registration."""
        self._seq = 0
        self._register_failures = 0

    def step(self) -> float:
        """One pass of the loop: register if needed, else heartbeat and apply the answer; the
        seconds until the next."""
        state = self.state
        if state.need_register.is_set() and not self._register():
            self._register_failures += 1
            return min(5.0, 0.25 * 2 ** min(self._register_failures, 5))
        started = time.monotonic()
        self._seq += 1
        sent_at, known = self.desired.holding()
        request = HeartbeatRequest(
            agent_instance=state.instance,
            seq=self._seq,
            attempts=self._listed_attempts(),
            known=known,
        )
        try:
            resp = state.client.heartbeat(request)
        except Unauthorized:
            # The control plane forgot this node (e.g. its database was reset): register again.
            state.log.warning("heartbeat_unauthorized_reregistering")
            state.need_register.set()
            self._register_failures += 1
            return min(5.0, 0.1 * 2 ** min(self._register_failures, 5))
        except (ControlPlaneUnavailable, RequestRejected) as exc:
            state.log.warning("heartbeat_failed", error=str(exc))
            # Not a whole (scaled, perhaps 30 s) interval: after an outage the control plane's startup
            # grace (15 s) must see this node again before it calls it lost.
            return min(state.heartbeat_interval_s, RETRY_AFTER_FAILURE_S * random.uniform(0.5, 1.0))
        self._register_failures = 0
        # The control plane stretches the interval as the cluster grows (its node-lost timeout grows
        # by as much, so the request timeout set at registration still fits).
        state.heartbeat_interval_s = resp.heartbeat_interval_s
        self.desired.reconcile(resp.assignments, resp.unchanged, sent_at=sent_at)
        state.heartbeat_done.set()
        # Jittered (never longer than told): a thousand agents do not stay in step after an outage
        # or a wake-up that reached many of them at once.
        period = state.heartbeat_interval_s * random.uniform(1 - HEARTBEAT_JITTER, 1.0)
        return max(0.0, period - (time.monotonic() - started))

    def _register(self) -> bool:
        state = self.state
        request = RegisterRequest(
            name=state.config.name,
            address=state.config.address,
            gpus=state.gpus,
            labels=state.config.labels,
            agent_version=AGENT_VERSION,
            agent_instance=state.instance,
            memory_port=state.memory_port,
            memory_tls=state.memory_port is not None and state.config.memory_tls_cert is not None,
        )
        if state.superseded is not None:
            return False
        try:
            resp = state.client.register(request, state.client.node_token or credential.load(state.config.work_dir))
        except TlsMismatch as exc:
            state.log.error("control_plane_tls_mismatch", error=str(exc))
            return False
        except ControlPlaneUnavailable as exc:
            state.log.info("control_plane_unreachable", error=str(exc))
            return False
        except (Unauthorized, RequestRejected, StaleAttempt) as exc:  # StaleAttempt: a 409, the name is taken
            state.log.error("registration_rejected", error=str(exc))
            return False
        try:
            credential.save(state.config.work_dir, resp.node_token)
        except OSError as exc:  # a restart then needs a join token again; this run goes on
            state.log.error("node_credential_not_saved", error=str(exc))
        state.node_id = resp.node_id
        state.epoch = resp.agent_epoch
        if state.memory is not None:
            # The memory port accepts the grants the control plane derives from this credential's
            # hash (trainyard/protocol/memtier.py): a new registration, a new key.
            state.memory.grant_key = memory_grant_key(resp.node_token)
        state.heartbeat_interval_s = resp.heartbeat_interval_s
        # Each try of a heartbeat ends early enough that it and its retries are over before the node
        # is declared lost (docs/architecture.md, "Time and timeouts").
        state.client.set_heartbeat_timeout(max(0.1, min(state.config.http_timeout_s, agent_request_timeout_s(
            resp.heartbeat_interval_s, resp.node_lost_timeout_s))))
        state.storage = dict(resp.storage)
        state.log = log.bind(node=state.config.name, node_id=resp.node_id)
        with state.runs_lock:  # what this instance launches from now on carries the node's id
            if state.node is not None:
                state.node = dataclasses.replace(state.node, node_id=resp.node_id)
        state.orphans.node_id = resp.node_id
        # Before the first heartbeat after a registration: no heartbeat of this instance may omit an
        # orphan of this node (node_agent/ranks/orphans.py).
        self.sweep_orphans(processes.scan())
        state.need_register.clear()
        state.registered.set()
        state.log.info("registered", heartbeat_interval_s=resp.heartbeat_interval_s, instance=state.instance,
                      epoch=resp.agent_epoch)
        return True

    def _alive_attempts(self) -> list[str]:
        """Attempts with processes on this node: ours, and orphans still being stopped."""
        state = self.state
        return sorted({run.attempt_id for run in state.runs() if run.alive} | state.orphans.alive)

    def _listed_attempts(self) -> list[LocalAttempt]:
        """What the heartbeat lists: every attempt with live processes (orphans included), and every
        finished one until its final status is acknowledged, not only while its processes live: the
        control plane must not read "vanished" into a report still on its way."""
        state = self.state
        alive = set(self._alive_attempts())
        listed = [LocalAttempt(attempt_id=attempt_id) for attempt_id in sorted(alive)]
        listed += [
            LocalAttempt(attempt_id=run.attempt_id, processes_alive=False, final_status_pending=True)
            for run in state.runs()
            if run.attempt_id not in alive and not (run.final_acked or run.stale)
        ]
        return listed
