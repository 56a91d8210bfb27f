"""The supervise loop: look at local processes and rank files, escalate stops from SIGTERM to
SIGKILL, sweep this node's orphaned processes; and, for the agent's lifecycle, adopt the parts an
earlier instance left in the work dir and stop every worker at shutdown."""

from __future__ import annotations

import time
from collections.abc import Callable
from http import HTTPStatus

from node_agent.confinement import processes
from node_agent.loops.state import AgentState
from node_agent.part.attempt import Part

_ORPHAN_SCAN_S = 5.0
"""How often an agent looks for orphaned workers of its node in the whole process table (each pass
while some are being stopped; at once after each registration, loops/heartbeat.py)."""
STANDBY_HOLD_MAX_S = 30.0
"""How long after a part arrived its start holds back the standbys that replace those it took
(a script that never reports a step must not keep the node without standbys for longer)."""
STALE_LOGS_DRAIN_S = 10.0
"""How long an ended, fenced-off part's last log lines may take to go out (normally one report
round, half a second) before its worker directory is removed all the same."""


class SuperviseLoop:
    def __init__(self, state: AgentState, *, launch_pending: Callable[[], None]) -> None:
        self.state = state
        self.launch_pending = launch_pending
        """Start the parts held while a live part had their GPUs (the desired state's,
        loops/desired.py): after a pass, some may be free."""
        self._next_orphan_scan = 0.0

    def step(self) -> float:
        """One pass of the loop; the seconds until the next."""
        state = self.state
        runs = state.runs()
        for run in runs:
            run.enforce_limits()  # before the scan below, which a part's fork bomb slows down
        scan_orphans = bool(state.orphans.alive) or time.monotonic() >= self._next_orphan_scan
        confined = self._confined_pids(runs)
        table = None
        if scan_orphans or (runs and confined is None):  # one scan of the process table for all
            table = processes.scan()
            self.sweep_orphans(table)
            self._next_orphan_scan = time.monotonic() + _ORPHAN_SCAN_S
        elif runs:
            table = processes.scan(only=confined)  # every part in a cgroup: their processes alone
        timeout_s = state.config.handover_timeout_s
        for attempt_id in state.handovers.expired():
            parked = state.run(attempt_id)
            if parked is not None and parked.parked:
                state.unpark(parked, f"not taken over within {timeout_s:g}s: the next attempt starts it cold")
            else:
                state.handovers.give_up(attempt_id, f"not taken over within {timeout_s:g}s")
        for run in runs:
            try:
                self._supervise(run, table)
            except Exception:  # one attempt's trouble must not stop the others being supervised
                run.log.exception("supervise_failed")
        if state.pending:
            self.launch_pending()  # a part whose GPUs a run held that is gone now
        if state.standbys is not None and not state.stop_event.is_set():
            # A fresh standby for each that a rank took, once no part of this node is starting: a
            # standby's imports (seconds of CPU) beside a recovery's ranks slowed their start by
            # half, even at idle priority (docs/architecture.md, "Warm standbys").
            state.standbys.refill(hold=self._starting(runs))
        return state.config.poll_interval_s

    def _starting(self, runs: list[Part]) -> bool:
        """Some part of this node is starting: received within STANDBY_HOLD_MAX_S, still running,
        and not every one of its ranks has reported a step yet."""
        now, reports = time.monotonic(), self.state.reports
        return any(
            run.received_at is not None and now - run.received_at < STANDBY_HOLD_MAX_S
            and not run.spec.command  # its own launcher: it takes no standby
            and not (run.done or run.finished or run.stale)
            and not reports.stepped(run.attempt_id, run.spec.nproc_per_node)
            for run in runs
        )

    @staticmethod
    def _confined_pids(runs: list[Part]) -> set[int] | None:
        """The processes of these parts when every one has a cgroup (which is where a part's
        processes are found, node_agent/part/attempt.py); None when some part has none."""
        pids: set[int] = set()
        for run in runs:
            cgroup = run.confinement.cgroup
            if cgroup is None:
                return None
            pids |= cgroup.pids()
            if run.pid:
                pids.add(run.pid)
        return pids

    def adopt_existing(self) -> None:
        """Take back the parts an earlier instance left in the work dir (part/parts.py)."""
        state = self.state
        assert state.parts is not None
        seen, runs = state.parts.adopt_all()
        state.known |= seen  # whatever their state: never launched again
        for run in runs:
            state.by_id[run.attempt_id] = run
            if run.spec.restartable:
                state.handovers.register(run.attempt_id, run.spec.fencing_token, node_rank=run.spec.node_rank,
                                         nproc=run.spec.nproc_per_node)
                if run.parked and run.parked_until is not None:
                    # Parked by the previous instance: the same deadline (the supervise loop stops it
                    # at once if it passed), never a fresh one.
                    state.handovers.park(run.attempt_id, max(0.0, run.parked_until - time.time()))
            if run.spec.version:
                state.versions[run.attempt_id] = run.spec.version
            state.reports.register(run.attempt_id, run.spec.fencing_token)

    def sweep_orphans(self, table: processes.ProcessTable) -> None:
        """Stop this node's processes that no attempt of this instance owns (node_agent/ranks/orphans.py);
        their attempts are never launched by this instance."""
        state = self.state
        # Listed before the owned attempts are read: a launch makes its cgroup and joins by_id under
        # the lock, so every cgroup listed here belongs to an attempt that is in by_id by then.
        tree = state.isolation.cgroups if state.isolation is not None else None
        cgroups = tree.parts(state.node_id) if tree is not None and state.node_id is not None else None
        with state.runs_lock:  # after the scan: a launch that the scan saw is in by_id by now
            owned = set(state.by_id)
            # Processes taken over from a parked part still carry the attempt they started for.
            owned |= {run.marker[0] for run in state.by_id.values() if run.marker is not None}
        before = state.orphans.alive
        new = state.orphans.sweep(table, owned, cgroups)
        with state.runs_lock:
            state.known |= new
        if state.orphans.alive != before:
            state.wake("heartbeat")

    def stop_all_workers(self, deadline: float) -> None:
        """Stop every part's processes: SIGTERM, SIGKILL at ``deadline`` (the agent's shutdown)."""
        state = self.state
        runs = [run for run in state.runs() if run.alive]
        for run in runs:
            run.request_stop("agent shutting down")
        while time.monotonic() < deadline:
            for run in runs:
                run.poll()
            if not any(run.alive for run in runs):
                return
            time.sleep(state.config.poll_interval_s)
        for run in runs:
            run.kill_now()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(run.alive for run in runs):
            time.sleep(0.05)
            for run in runs:
                run.poll()
        left = [run.attempt_id for run in runs if run.alive]
        if left:
            state.log.error("workers_left_running", attempts=left)

    def _supervise(self, run: Part, table: processes.ProcessTable | None) -> None:
        state = self.state
        before = run.signature()
        run.poll(table)
        after = run.signature()
        wakeups = state.supervise_wakeups
        if wakeups is not None and run.alive and not run.preparing:
            # The next rank file or exit wakes this loop at once (loops/wake.py).
            wakeups.watch_dir(run.paths.status_dir)
            wakeups.watch_pids(run.watched_pids())
        if after != before:
            # A worker started or exited, or the last process went: tell the control plane at
            # once (a failure is decided, or the GPUs are released, a period sooner). When the
            # last process went, the final report (processes_alive false) releases the GPUs; the
            # heartbeat is woken as well only when that report cannot go out now (a fenced-off
            # run, shards still queued before it) or did not release them (loops/report.py).
            gone = before[0] and not after[0]
            beat = after[0] != before[0] and (
                not gone or run.stale or state.outbox.pending(run.attempt_id) > 0)
            state.wake("report", *(("heartbeat",) if beat else ()))
        if not run.alive and run.stale and not run.done and not (run.logs_closed or run.parked):
            # Fenced off and ended: its last log lines go out first (the report loop ships them),
            # for a bounded time; its worker directory, which holds them, is removed after.
            now = time.monotonic()
            if run.logs_deadline is None:
                run.logs_deadline = now + STALE_LOGS_DRAIN_S
                state.wake("report")
            if now < run.logs_deadline:
                return
            run.log.warning("stale_logs_not_shipped", waited_s=STALE_LOGS_DRAIN_S)
        if not run.alive and (run.done or run.stale):
            if run.stale:
                run.mark_done()  # nothing more to tell about a fenced-off attempt
            with state.runs_lock:
                state.by_id.pop(run.attempt_id, None)
            if wakeups is not None:
                wakeups.forget_dir(run.paths.status_dir)
            state.reports.unregister(run.attempt_id)
            state.handovers.forget(run.attempt_id)
            for earlier in run.handed_over_from():
                state.handovers.forget(earlier)
            state.refused_reports.pop(run.attempt_id, None)
            state.outbox.drop(run.attempt_id, HTTPStatus.CONFLICT, "the attempt ended")
            if state.parts is not None:
                state.parts.finish(run)
