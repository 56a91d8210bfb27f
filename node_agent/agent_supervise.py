"""The agent's supervision of its runs: look at local processes and rank files, escalate stops
from SIGTERM to SIGKILL, sweep this node's orphaned processes, adopt the attempts an earlier
instance left in the work dir, and stop every worker at shutdown."""

from __future__ import annotations

import time
from http import HTTPStatus

from node_agent import processes
from node_agent.agent_core import AgentCore
from node_agent.attempt import AttemptRun

_ORPHAN_SCAN_S = 5.0  # how often an agent with no attempt looks for orphaned workers of its node
STALE_LOGS_DRAIN_S = 10.0
"""How long an ended, fenced-off part's last log lines may take to go out (normally one report
round, half a second) before its worker directory is removed all the same."""

class SuperviseLoop(AgentCore):
    def _launch_pending(self) -> None:
        """Start the specs kept pending while a live part held their GPUs (agent_desired.DesiredState,
        the mixin that owns them; Agent combines both)."""
        raise NotImplementedError
    def _adopt_existing(self) -> None:
        assert self._launches is not None
        seen, runs = self._launches.adopt_all()
        self._known |= seen  # whatever their state: never launched again
        for run in runs:
            self._runs[run.attempt_id] = run
            if run.spec.restartable:
                self.handovers.register(run.attempt_id, run.spec.fencing_token, node_rank=run.spec.node_rank,
                                        nproc=run.spec.nproc_per_node)
                if run.parked and run.parked_until is not None:
                    # Parked by the previous instance: the same deadline (the supervise loop stops it
                    # at once if it passed), never a fresh one.
                    self.handovers.park(run.attempt_id, max(0.0, run.parked_until - time.time()))
            if run.spec.version:
                self._versions[run.attempt_id] = run.spec.version
            self.reports.register(run.attempt_id, run.spec.fencing_token)

    def _sweep_orphans(self, table: processes.ProcessTable) -> None:
        """Stop this node's processes that no attempt of this instance owns (node_agent/orphans.py);
        their attempts are never launched by this instance."""
        # Listed before the owned attempts are read: a launch makes its cgroup and joins _runs under
        # the lock, so every cgroup listed here belongs to an attempt that is in _runs by then.
        tree = self.isolation.cgroups if self.isolation is not None else None
        cgroups = tree.parts(self.node_id) if tree is not None and self.node_id is not None else None
        with self._runs_lock:  # after the scan: a launch that the scan saw is in _runs by now
            owned = set(self._runs)
            # Processes taken over from a parked part still carry the attempt they started for.
            owned |= {run.marker[0] for run in self._runs.values() if run.marker is not None}
        before = self.orphans.alive
        new = self.orphans.sweep(table, owned, cgroups)
        with self._runs_lock:
            self._known |= new
        if self.orphans.alive != before:
            self._wake("heartbeat")

    def _stop_all_workers(self, deadline: float) -> None:
        runs = [run for run in self.runs() if run.alive]
        for run in runs:
            run.request_stop("agent shutting down")
        while time.monotonic() < deadline:
            for run in runs:
                run.poll()
            if not any(run.alive for run in runs):
                return
            time.sleep(self.config.poll_interval_s)
        for run in runs:
            run.kill_now()
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(run.alive for run in runs):
            time.sleep(0.05)
            for run in runs:
                run.poll()
        left = [run.attempt_id for run in runs if run.alive]
        if left:
            self.log.error("workers_left_running", attempts=left)

    def _supervise_step(self) -> float:
        runs = self.runs()
        for run in runs:
            run.enforce_limits()  # before the scan below, which a part's fork bomb slows down
        scan_orphans = bool(self.orphans.alive) or time.monotonic() >= self._next_orphan_scan
        table = processes.scan() if runs or scan_orphans else None  # one scan of the process table for all
        if table is not None:
            self._sweep_orphans(table)
            self._next_orphan_scan = time.monotonic() + _ORPHAN_SCAN_S
        for attempt_id in self.handovers.expired():
            parked = self.run(attempt_id)
            if parked is not None and parked.parked:
                self._unpark(parked, f"not taken over within {self.config.handover_timeout_s:g}s: "
                             "the next attempt starts it cold")
            else:
                self.handovers.give_up(attempt_id, f"not taken over within {self.config.handover_timeout_s:g}s")
        for run in runs:
            try:
                self._supervise(run, table)
            except Exception:  # one attempt's trouble must not stop the others being supervised
                run.log.exception("supervise_failed")
        if self._pending:
            self._launch_pending()  # a part whose GPUs a run held that is gone now
        if self._standbys is not None and not self._stop_event.is_set():
            self._standbys.refill()  # a fresh standby for each that a rank took
        return self.config.poll_interval_s

    def _supervise(self, run: AttemptRun, table: processes.ProcessTable | None) -> None:
        before = run.signature()
        run.poll(table)
        after = run.signature()
        wakeups = self._supervise_wakeups
        if wakeups is not None and run.alive and not run.preparing:
            # The next rank file or exit wakes this loop at once (supervise_wake.py).
            wakeups.watch_dir(run.paths.status_dir)
            wakeups.watch_pids(run.watched_pids())
        if after != before:
            # A worker started or exited, or the last process went: tell the control plane at
            # once (a failure is decided, or the GPUs are released, a period sooner). When the
            # last process went, the final report (processes_alive false) releases the GPUs; the
            # heartbeat is woken as well only when that report cannot go out now (a fenced-off
            # run, shards still queued before it) or did not release them (_report_status).
            gone = before[0] and not after[0]
            beat = after[0] != before[0] and (
                not gone or run.stale or self.outbox.pending(run.attempt_id) > 0)
            self._wake("report", *(("heartbeat",) if beat else ()))
        if not run.alive and run.stale and not run.done and not (run.logs_closed or run.parked):
            # Fenced off and ended: its last log lines go out first (the report loop ships them),
            # for a bounded time; its worker directory, which holds them, is removed after.
            now = time.monotonic()
            if run.logs_deadline is None:
                run.logs_deadline = now + STALE_LOGS_DRAIN_S
                self._wake("report")
            if now < run.logs_deadline:
                return
            run.log.warning("stale_logs_not_shipped", waited_s=STALE_LOGS_DRAIN_S)
        if not run.alive and (run.done or run.stale):
            if run.stale:
                run.mark_done()  # nothing more to tell about a fenced-off attempt
            with self._runs_lock:
                self._runs.pop(run.attempt_id, None)
            if wakeups is not None:
                wakeups.forget_dir(run.paths.status_dir)
            self.reports.unregister(run.attempt_id)
            self.handovers.forget(run.attempt_id)
            for earlier in run.handed_over_from():
                self.handovers.forget(earlier)
            self._refused_reports.pop(run.attempt_id, None)
            self.outbox.drop(run.attempt_id, HTTPStatus.CONFLICT, "the attempt ended")
            if self._launches is not None:
                self._launches.finish(run)
