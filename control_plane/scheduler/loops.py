"""Background loops of a control-plane replica: scheduling passes, node liveness, time limits,
checkpoint maintenance, retention of logs and events, and the watchdogs (hung attempts, stragglers,
the auto checkpoint interval).

Each loop runs in its own thread under a ``Loops`` monitor with an idempotent ``stop``. A loop
iteration is one short transaction; an exception is logged and the loop carries on. Every
replica runs them: the scheduler's advisory lock and ``SKIP LOCKED`` claims make that safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import structlog
from sqlalchemy.orm import Session, sessionmaker

from control_plane import clock
from control_plane.clock import now
from control_plane.db import session_scope
from control_plane.scheduler.allocate import PASS_LOCK_BUSY, PendingCache, schedule_pass
from control_plane.services.checkpoints import checkpoints, storage_sweep, upload_slots
from control_plane.services.cluster import nodes
from control_plane.services.read import metrics
from control_plane.services.runs import attempts, intervals, limits, retention, status_reports, watchdog
from control_plane.settings import Settings

log = structlog.get_logger("trainyard.loops")


class Loops:
    NAMES = ("scheduler", "monitor", "checkpoints", "limits", "watchdog", "retention")
    THREADS = len(NAMES)
    """Threads ``start`` runs, each holding at most one connection at a time."""

    def __init__(self, factory: sessionmaker[Session], settings: Settings, store: object | None = None,
                 liveness_wait: Callable[[], float] | None = None) -> None:
        self._factory = factory
        # How long this replica's oldest unanswered heartbeat has waited (control_plane/lanes.py): the
        # monitor declares no node lost whose heartbeat may be that one (services/cluster/lost_policy.py).
        self._liveness_wait = liveness_wait or (lambda: 0.0)
        self._store = store
        self._settings = settings
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._pending = PendingCache()  # used by the scheduler thread only
        # After a (re)start, agents need time to reach us again before anyone is declared lost.
        self._not_before = now() + timedelta(seconds=settings.startup_grace_s)

    def wake_scheduler(self) -> None:
        self._wake.set()

    def start(self) -> None:
        if self._threads:
            return
        loops: dict[str, tuple[Callable[[], object], float]] = {
            "scheduler": (self.schedule_once, self._settings.scheduler_interval_s),
            "monitor": (self.monitor_once, self._settings.monitor_interval_s),
            "checkpoints": (self.checkpoints_once, self._settings.checkpoint_maintenance_interval_s),
            "limits": (self.limits_once, self._settings.limits_interval_s),
            "watchdog": (self.watchdog_once, self._settings.watchdog_interval_s),
            "retention": (self.retention_once, self._settings.retention_interval_s),
        }
        assert tuple(loops) == self.NAMES  # THREADS sizes the connection pool (app.py)
        for name, (fn, period) in loops.items():
            t = threading.Thread(target=self._run, args=(name, fn, period), name=f"trainyard-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()

    BUSY_RETRY_S = 0.05
    """How soon a pass run for a wake-up tries again when another pass held the pass lock."""

    def _run(self, name: str, fn: Callable[[], object], period: float) -> None:
        if name == "scheduler":
            self._run_scheduler(period)
            return
        while not self._stop.is_set():
            try:
                fn()
            except Exception:
                log.exception("loop iteration failed", loop=name)
            self._stop.wait(period)

    def _run_scheduler(self, period: float) -> None:
        woken = False
        while not self._stop.is_set():
            self._wake.clear()  # before the pass: a wake-up during it runs another one at once
            busy = False
            try:
                busy = self._schedule()[1]
            except Exception:
                log.exception("loop iteration failed", loop="scheduler")
            # A pass run for a wake-up that found the lock taken: the pass holding it (a request
            # thread's, or another replica's) may have read the cluster before the change that woke
            # this loop committed (the last release of a gang), so pass again once it is over, not a
            # period later. A periodic pass that finds the lock taken does not retry: the pass that
            # held it served the same period.
            retry = woken and busy
            woken = not self._stop.wait(self.BUSY_RETRY_S) if retry else self._wake.wait(period)

    def schedule_once(self) -> int:
        return self._schedule()[0]

    def _schedule(self) -> tuple[int, bool]:
        """One pass: the gangs it admitted, and whether it found another pass holding the lock."""
        session = self._factory()
        try:
            with metrics.SCHEDULING_PASS.time():
                admitted = len(schedule_pass(session, self._settings, cache=self._pending))
            return admitted, bool(session.info.get(PASS_LOCK_BUSY))
        finally:
            session.close()

    def monitor_once(self) -> int:
        try:
            bind = getattr(self._factory, "kw", {}).get("bind")
            if bind is not None:
                clock.maybe_anchor(bind)  # liveness compares instants other replicas wrote
            waited = self._liveness_wait()  # before the nodes are read: see mark_lost_nodes
            with session_scope(self._factory) as session:
                lost = nodes.mark_lost_nodes(
                    session, timeout_s=self._settings.node_lost_timeout_s, not_before=self._not_before,
                    interval_s=self._settings.heartbeat_interval_s,  # a node told longer waits longer
                    local_oldest_s=waited,
                )
            with session_scope(self._factory) as session:
                # After the lost nodes committed: a cancelling job whose release committed but was
                # not finished (a crash before attempts.finish_released) is cancelled here.
                ended = attempts.finish_stopped(session)
            unlaunched: list[object] = []
            if now() >= self._not_before:  # agents get the same grace to report a launch
                with session_scope(self._factory) as session:
                    # Parts never confirmed launching: after the lost nodes, so a silent node is
                    # blamed as lost (the clearer reason) before its parts time out.
                    unlaunched = list(attempts.fail_unlaunched(
                        session, timeout_s=self._settings.attempt_launch_timeout_s))
        except Exception:
            # The database was unreachable, so heartbeats were refused too: once it is back, give
            # the agents the same grace as after a restart before calling anyone lost.
            self._not_before = now() + timedelta(seconds=self._settings.startup_grace_s)
            raise
        decided = self._settle_undecided()
        if lost or unlaunched or ended or decided:
            self.wake_scheduler()
        return len(lost)

    def _settle_undecided(self) -> int:
        """Failures that waited for their cause's report when none came (its node died): decided once
        the grace is over or the cause's node went silent (status_reports.undecided). Each attempt in
        its own transaction; one's trouble is logged and left for the next pass, and never taken for
        a database outage (which would hold back every node's liveness)."""
        silence = status_reports.Silence(interval_s=self._settings.heartbeat_interval_s, not_before=self._not_before)
        decided = 0
        try:
            with session_scope(self._factory) as session:
                ids = status_reports.undecided(session)
        except Exception:
            log.exception("loop iteration failed", loop="monitor", step="undecided")
            return 0
        for attempt_id in ids:
            try:
                with session_scope(self._factory) as session:
                    attempt = status_reports.settle(session, attempt_id, silence=silence)
                    decided += attempt is not None and attempt.outcome is not None
            except Exception:
                log.exception("settle_failed", attempt_id=str(attempt_id))
        return decided

    def limits_once(self) -> int:
        """Stop attempts past their job's time limit (no network calls: agents learn at heartbeat)."""
        with session_scope(self._factory) as session:
            failed = limits.enforce_time_limits(session)
        return len(failed)

    def watchdog_once(self) -> int:
        """Fail hung attempts (recovered like any failure), name stragglers, reset 'auto' checkpoint
        intervals (services/runs/watchdog.py, services/runs/intervals.py); each in its own transactions."""
        if now() < self._not_before:
            return 0  # after a start, progress reports need time to reach us again
        with session_scope(self._factory) as session:
            hung = watchdog.fail_hung(session, self._settings)
        with session_scope(self._factory) as session:
            hung += watchdog.fail_not_started(session, self._settings)
        with session_scope(self._factory) as session:
            watchdog.track_stragglers(session, self._settings)
        with session_scope(self._factory) as session:
            intervals.update(session, self._settings)
        if hung:
            self.wake_scheduler()
        return len(hung)

    def retention_once(self) -> tuple[int, int]:
        """Delete logs and events past their retention (services/runs/retention.py)."""
        st = self._settings
        done = retention.apply(self._factory, log_days=st.log_retention_days, event_days=st.event_retention_days,
                               batch=st.retention_batch)
        # Code archives no job needs any more (services/checkpoints/storage_sweep.py); after the rows, so an
        # unreachable S3 holds up nothing else.
        storage_sweep.sweep_code(self._factory, self._store, unreferenced_days=st.code_unreferenced_days)
        return done

    def checkpoints_once(self) -> None:
        checkpoints.maintenance(
            self._factory, self._store,  # type: ignore[arg-type]
            pending_timeout_s=self._settings.checkpoint_pending_timeout_s,
        )
        if self._store is not None:  # granted objects never reported (services/checkpoints/storage_sweep.py)
            storage_sweep.sweep_grants(self._factory, self._store)
        # Slots of crashed holders are reclaimed and their waiters served even when no request comes.
        upload_slots.maintenance(self._factory, self._settings)
