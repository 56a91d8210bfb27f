"""The node's desired state: the wait loop (a long poll that learns of changes at once), and
applying an answer, from it or from a heartbeat (loops/heartbeat.py): launch what is assigned and
was never launched here, stop what runs and no longer is."""

from __future__ import annotations

import random
import time
from typing import BinaryIO

from node_agent.link.client import (
    ControlPlaneError,
    ControlPlaneUnavailable,
    RequestRejected,
    Unauthorized,
)
from node_agent.loops.state import AgentState, PendingLaunch
from node_agent.part.attempt import Part
from node_agent.part.code import CodeUnavailable, ShippedCode
from trainyard.protocol.agent import (
    AssignmentRef,
    KnownAssignment,
    LaunchSpec,
    WaitRequest,
)

HEARTBEAT_JITTER = 0.2
"""A heartbeat leaves between (1 - this) and 1 times the interval after the previous one started."""
WAIT_TIMEOUT_S = 25.0
"""How long one long poll (POST /v1/agent/wait) stays open at least; twice the heartbeat interval when
that is longer (each wait costs the control plane a read when it starts), at most WAIT_TIMEOUT_MAX_S.
The control plane may cut it shorter (agent_wait_timeout_s)."""
WAIT_TIMEOUT_MAX_S = 110.0


class DesiredState:
    def __init__(self, state: AgentState) -> None:
        self.state = state

    def step(self) -> float:
        """The wait loop. Keep one long poll open; when the control plane says the node's desired
        state changed (a new attempt, a stop order), apply the desired state the answer carries (or,
        from a control plane that sends none, heartbeat now) rather than wait for the next heartbeat,
        whose interval grows with the cluster. Then wait again, with the versions that brought."""
        state = self.state
        if not state.registered.is_set() or state.need_register.is_set():
            return 1.0
        sent_at, known = self.holding()
        try:
            timeout = min(WAIT_TIMEOUT_MAX_S, max(WAIT_TIMEOUT_S, 2 * state.heartbeat_interval_s))
            timeout *= random.uniform(1 - HEARTBEAT_JITTER, 1.0)  # waits woken together re-arm spread out
            resp = state.client.wait(WaitRequest(known=known, timeout_s=timeout, answer=True))
        except Unauthorized:
            state.wake("heartbeat")  # it registers again
            return 1.0
        except RequestRejected as exc:  # e.g. a control plane without long polls (404): heartbeats only
            state.log.info("long_poll_refused", error=str(exc))
            return 60.0
        except ControlPlaneUnavailable:
            return state.heartbeat_interval_s
        if resp.changed and resp.assignments is not None:
            self.reconcile(resp.assignments, resp.unchanged, sent_at=sent_at)
        elif resp.changed:
            state.heartbeat_done.clear()
            state.wake("heartbeat")
            state.heartbeat_done.wait(state.heartbeat_interval_s)  # the next wait knows its answer
        return 0.0

    def holding(self) -> tuple[float, list[KnownAssignment]]:
        """When a request leaves and the spec versions it reports (taken together: see reconcile)."""
        state = self.state
        with state.reconcile_lock:
            return time.monotonic(), [KnownAssignment(attempt_id=a, version=v)
                                      for a, v in sorted(state.versions.items())]

    def reconcile(self, assignments: list[LaunchSpec], unchanged: list[AssignmentRef] | None = None, *,
                  sent_at: float | None = None) -> None:
        """Full specs are new or changed assignments; `unchanged` names the specs this agent holds
        that are still assigned ('run') or not ('stop'). A spec for an attempt launched before is
        never launched again: only its version is kept.

        Answers come from the heartbeat and from the long poll, each read by the control plane at
        its own moment: an answer to a request sent (``sent_at``) before an attempt was launched
        may have been read before that attempt was assigned, so its silence about it is no order to
        stop it (an explicit stop comes with the next answer that knows it)."""
        state = self.state
        arrived = time.monotonic()  # a part's wake-up ends here (received_s_ago), its code fetch is process start
        with state.reconcile_lock:
            refs = unchanged or []
            assigned = {spec.attempt_id for spec in assignments}
            assigned |= {ref.attempt_id for ref in refs if ref.desired == "run"}
            newer = {a for a, t in state.launched_at.items() if sent_at is not None and t > sent_at}
            # Forget the versions of what is no longer assigned: if it ever came back, so would its spec.
            state.versions = {a: v for a, v in state.versions.items() if a in assigned or a in newer}
            for spec in assignments:
                if spec.version:
                    state.versions[spec.attempt_id] = spec.version
                state.launched_at.setdefault(spec.attempt_id, time.monotonic())
                self.launch(spec.model_copy(update={"storage": {**state.storage, **spec.storage}}),
                            self._code(spec), received=arrived)
            said = {ref.attempt_id: ref.handover_ok for ref in refs if ref.desired == "stop"}
            for run in state.runs():
                if run.alive and not run.stopping and run.attempt_id not in assigned | newer:
                    state.stop_or_park(run, "no longer assigned to this node", handover_ok=said.get(run.attempt_id))
            # Kept while assigned or too new to judge, with a version or without one (a control plane
            # that sends none): the guard above holds for both.
            state.launched_at = {a: t for a, t in state.launched_at.items() if a in assigned or a in newer}

    def launch(self, spec: LaunchSpec, code: ShippedCode | None = None, *, received: float | None = None) -> None:
        """Start ``spec``'s part, at most once in this agent's life (or hold it while its GPUs are busy)."""
        state = self.state
        assert state.node is not None and state.parts is not None
        with state.runs_lock:
            if spec.attempt_id in state.known or state.stop_event.is_set():
                return
            state.known.add(spec.attempt_id)  # at most once in this agent's life, whatever happens
            if spec.launched:
                # Started by an earlier instance of this node whose work dir is gone: its processes,
                # if any, were swept as orphans; starting it again would run it twice.
                state.log.warning("attempt_started_by_another_instance_not_launching", attempt_id=spec.attempt_id)
                return
            # Registered first: its workers may report as soon as they run.
            state.reports.register(spec.attempt_id, spec.fencing_token)
            if spec.restartable:
                state.handovers.register(spec.attempt_id, spec.fencing_token, node_rank=spec.node_rank,
                                         nproc=spec.nproc_per_node)
            self._start_or_hold(PendingLaunch(spec, code, received if received is not None else time.monotonic()))

    def launch_pending(self) -> None:
        """Start the pending parts whose GPUs are free now; forget those no longer assigned."""
        state = self.state
        with state.runs_lock:
            for attempt_id, pending in list(state.pending.items()):
                if state.stop_event.is_set() or attempt_id not in state.launched_at:
                    state.pending.pop(attempt_id, None)
                    state.reports.unregister(attempt_id)
                    state.handovers.forget(attempt_id)
                    continue
                self._start_or_hold(pending)

    def _start_or_hold(self, pending: PendingLaunch) -> None:
        """Start the part (taking over the parked part it adopts, if it can), or hold it pending while
        a live part of this node still has any of its GPUs, or any orphan lives: two owners of a GPU
        never run at once, whatever the control plane believed when it assigned them (a parked part
        being stopped, a takeover that could not relabel, leases passed from a stopping part). A
        parked part in the way is stopped. Under runs_lock."""
        state = self.state
        assert state.node is not None and state.parts is not None
        spec = pending.spec
        run = self._take_over(spec) if spec.adopts else None
        if run is None:
            busy = [r for r in state.by_id.values() if r.alive and set(r.spec.gpu_indices) & set(spec.gpu_indices)]
            # Orphans (an earlier agent instance's processes, being stopped) hold GPUs this agent
            # cannot name: every new part waits for them. The control plane may have given their
            # GPUs to the job's next attempt already (lease passing: services/runs/handover.py).
            orphans = sorted(state.orphans.alive)
            if busy or orphans:
                for old in busy:
                    if old.parked:
                        state.unpark(old, f"its GPUs are assigned to attempt {spec.attempt_id}")
                if spec.attempt_id not in state.pending:
                    state.log.warning("attempt_pending_gpus_busy", attempt_id=spec.attempt_id,
                                      held_by=sorted(r.attempt_id for r in busy), orphans_of=orphans)
                state.pending[spec.attempt_id] = pending
                return
            run = state.parts.start(spec, state.node, state.gpus, code=pending.code)
        state.pending.pop(spec.attempt_id, None)
        if run is None:
            state.reports.unregister(spec.attempt_id)
            state.handovers.forget(spec.attempt_id)
            return
        run.received_at = pending.received
        state.by_id[spec.attempt_id] = run
        state.wake("supervise")  # it watches the new part's rank files and torchrun from now on

    def _take_over(self, spec: LaunchSpec) -> Part | None:
        """The part ``spec`` adopts, relabelled as ``spec``'s and its parked workers told their new
        assignment (node_agent/local/handover.py); None when it is not parked here (the caller starts the
        part cold once the GPUs are free; a parked part it did not take is stopped). The part is
        claimed first, so its handover deadline or a stop order cannot tell its workers to stop
        while it is being relabelled. Under runs_lock."""
        state = self.state
        assert spec.adopts is not None and state.parts is not None
        old = state.by_id.get(spec.adopts)
        if old is None or not old.parked or not state.handovers.claim(old.attempt_id):
            if spec.attempt_id not in state.pending:
                state.log.warning("handover_not_possible", attempt_id=spec.attempt_id, adopts=spec.adopts)
            return None
        run = state.parts.take_over(spec, old)
        if run is None:
            state.handovers.release(old.attempt_id)
            return None
        # From here the old attempt's token is stale on this node: only its parked workers' polls
        # (the handover registry) still hear about it, and they are told the new assignment.
        state.by_id.pop(old.attempt_id, None)
        state.reports.unregister(old.attempt_id)
        if not state.handovers.hand_over(old.attempt_id, spec, str(run.paths.socket) if run.paths.socket else None):
            # Its processes ended meanwhile: the new part reports their exit (a failed attempt, as
            # any lost rank), rather than starting a second set of workers on the same GPUs.
            state.log.error("handover_lost", attempt_id=spec.attempt_id, adopts=old.attempt_id)
        state.log.info("attempt_handed_over", attempt_id=spec.attempt_id, adopts=old.attempt_id, pid=run.pid)
        return run

    def _code(self, spec: LaunchSpec) -> ShippedCode | None:
        """How the part gets the job's code: fetched (once per content hash) and unpacked in the
        part's own thread when it starts (node_agent/part/code.py), never in this loop's."""
        if spec.code is None:
            return None
        state = self.state
        attempt_id, ref = spec.attempt_id, spec.code

        def fetch(out: BinaryIO, max_bytes: int, deadline: float) -> None:
            try:
                state.client.fetch_code(attempt_id, out, max_bytes, deadline)
            except ControlPlaneError as exc:
                state.log.error("code_fetch_failed", attempt_id=attempt_id, error=str(exc))
                raise CodeUnavailable(f"the job's code {ref.sha256[:12]} could not be fetched: {exc}") from exc

        return ShippedCode(ref, state.config.work_dir, fetch, state.config.code_limits)
