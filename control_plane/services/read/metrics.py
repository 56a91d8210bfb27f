"""Prometheus metrics (GET /metrics; docs/operations.md, "Metrics").

Two kinds, because several replicas serve one database:
- what the database knows (jobs and leases by state, the queue, goodput, reservations' idle
  GPU-time, hung attempts, stragglers) is read at scrape time by :class:`DatabaseCollector`, a few
  cheap grouped queries cached for ``metrics_cache_s``: every replica answers the same, so a
  dashboard takes max() across replicas, not sum();
- latencies a replica measures itself (scheduling passes, heartbeats, shard reports' checkpoint
  costs, recovery phases, queue waits at admission) are this process's histograms: sum them
  across replicas.
Labels never carry job names, ids or tenants: /metrics may be open (Settings.metrics_token).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session, sessionmaker

from control_plane.clock import now
from control_plane.models import Attempt, AttemptPart, Checkpoint, GpuLease, Job, Node
from control_plane.services import states
from control_plane.services.states import JOB_TERMINAL, JOB_WAITING
from trainyard.protocol.agent import ShardReport
from trainyard.protocol.exits import FAILURE_KINDS

PROCESS = CollectorRegistry(auto_describe=True)
"""This process's own measurements (module-level: one set however many apps a process creates)."""

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_LONG = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)
SCHEDULING_PASS = Histogram("trainyard_scheduling_pass_duration_seconds", "One scheduling pass, end to end.",
                            buckets=_LATENCY, registry=PROCESS)
HEARTBEAT = Histogram("trainyard_heartbeat_duration_seconds", "Handling one agent heartbeat (a pass included).",
                      buckets=_LATENCY, registry=PROCESS)
QUEUE_WAIT = Histogram("trainyard_queue_wait_seconds", "Submit (or failure) to allocation, at admission.",
                       ["kind"], buckets=_LONG, registry=PROCESS)
CKPT_BLOCKING = Histogram("trainyard_checkpoint_blocking_seconds", "Training blocked by one rank's save.",
                          buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 180, 600), registry=PROCESS)
CKPT_BACKGROUND = Histogram("trainyard_checkpoint_background_seconds",
                            "Hashing, upload and report of one rank's shard, after training went on.",
                            buckets=(0.01, 0.1, 0.5, 1, 5, 15, 60, 180, 600, 1800), registry=PROCESS)
CKPT_BYTES = Counter("trainyard_checkpoint_shard_bytes", "Bytes of checkpoint shards reported.", registry=PROCESS)
CKPT_THROUGHPUT = Histogram("trainyard_checkpoint_upload_bytes_per_second", "One shard's upload throughput.",
                            buckets=(1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9), registry=PROCESS)
RECOVERY_PHASE = Histogram("trainyard_recovery_phase_seconds",
                           "Phases of a recovery (detection, decision, wake_up, process_start, rendezvous, "
                           "restore, total), observed at the new attempt's first step.", ["phase"],
                           buckets=_LONG, registry=PROCESS)


def observe_shards(report: ShardReport) -> None:
    for shard in report.shards:
        CKPT_BYTES.inc(shard.size_bytes)
        if shard.blocking_s is not None:
            CKPT_BLOCKING.observe(shard.blocking_s)
        if shard.background_s is not None:
            CKPT_BACKGROUND.observe(shard.background_s)
            if shard.background_s > 0:
                CKPT_THROUGHPUT.observe(shard.size_bytes / shard.background_s)


def observe_recovery(phases: dict[str, float | None]) -> None:
    for phase, seconds in phases.items():
        if seconds is not None:
            RECOVERY_PHASE.labels(phase=phase).observe(seconds)


def _every(family: Any, names: Iterable[str], counts: Iterable[Any]) -> None:
    """One sample per name, 0 for those without a row (and any name the rows add)."""
    found = {str(name): n for name, n in counts}
    for name in dict.fromkeys([*names, *found]):
        family.add_metric([name], found.get(name, 0))


class DatabaseCollector(Collector):
    """Gauges and counters read from the database at scrape time, cached for ``cache_s``."""

    def __init__(self, factory: sessionmaker[Session], cache_s: float,
                 cluster_goodput: Callable[[Session], Any]) -> None:
        self._factory = factory
        self._cache_s = cache_s
        self._goodput = cluster_goodput
        self._lock = threading.Lock()
        self._at = -1e9
        self._families: list[Any] = []

    def collect(self) -> Iterator[Any]:
        with self._lock:  # one reader at a time; the others get its result
            if time.monotonic() - self._at > self._cache_s:
                session = self._factory()
                try:
                    self._families = self._read(session)
                finally:
                    session.rollback()
                    session.close()
                self._at = time.monotonic()
            families = list(self._families)
        yield from families

    def _read(self, session: Session) -> list[Any]:
        t = now()
        # Every state, 0 included: a series that vanishes at 0 reads as "no data" in a dashboard and
        # breaks rate() and alerts on it.
        jobs = GaugeMetricFamily("trainyard_jobs", "Jobs by state.", labels=["state"])
        _every(jobs, states.JOB, session.execute(select(Job.state, func.count()).group_by(Job.state)))
        queue = GaugeMetricFamily("trainyard_queue_length", "Jobs waiting for the scheduler.", labels=["state"])
        oldest = GaugeMetricFamily("trainyard_queue_oldest_wait_seconds", "The longest a waiting job has waited.")
        waiting = dict(session.execute(select(Job.state, func.count()).where(Job.state.in_(JOB_WAITING))
                                       .group_by(Job.state)).all())
        for state in JOB_WAITING:
            queue.add_metric([state], waiting.get(state, 0))
        first = session.scalar(select(func.min(Job.updated_at)).where(Job.state.in_(JOB_WAITING)))
        oldest.add_metric([], max((t - first).total_seconds(), 0.0) if first else 0.0)
        leases = GaugeMetricFamily("trainyard_gpu_leases", "GPU leases held, by what holds them.", labels=["state"])
        held = session.execute(
            select(func.count().filter(Job.state.not_in(JOB_TERMINAL)),
                   func.count().filter(Job.state.in_(JOB_TERMINAL)),
                   func.count().filter(Node.state != "ready"))
            .select_from(GpuLease).join(Job, Job.id == GpuLease.job_id).join(Node, Node.id == GpuLease.node_id)
            .where(GpuLease.released_at.is_(None))
        ).one()
        for state, n in zip(("active", "releasing", "on_unreachable_nodes"), held, strict=True):
            leases.add_metric([state], n)
        nodes = GaugeMetricFamily("trainyard_nodes", "Nodes by state.", labels=["state"])
        _every(nodes, states.NODE, session.execute(select(Node.state, func.count()).group_by(Node.state)))
        checkpoints = GaugeMetricFamily("trainyard_checkpoints", "Checkpoints by state.", labels=["state"])
        _every(checkpoints, states.CHECKPOINT,
               session.execute(select(Checkpoint.state, func.count()).group_by(Checkpoint.state)))
        failed = CounterMetricFamily(
            "trainyard_attempts_failed", "Failed attempts by cause: hung, or the attempt's failure kind "
            "(trainyard/protocol/exits.py: exception, signal, out_of_memory, node_lost, ...).", labels=["cause"])
        cause = case((Attempt.hung_since.is_not(None), "hung"), else_=func.coalesce(Attempt.failure_kind, "other"))
        _every(failed, ("hung", *FAILURE_KINDS), session.execute(
            select(cause, func.count()).where(Attempt.outcome == "failed").group_by(cause)))
        stragglers = GaugeMetricFamily("trainyard_stragglers", "Ranks of running attempts named stragglers.")
        stragglers.add_metric([], session.scalar(
            select(func.count()).select_from(AttemptPart).join(Attempt, Attempt.id == AttemptPart.attempt_id)
            .where(AttemptPart.straggler_named_at.is_not(None), Attempt.outcome.is_(None))) or 0)
        goodput = self._goodput(session)
        seconds = GaugeMetricFamily("trainyard_goodput_gpu_seconds",
                                    "The cluster's allocated GPU-time by what it bought (docs/goodput.md).",
                                    labels=["component"])
        for name in ("allocated", "productive", "checkpoint_stall", "lost_work", "recovery", "hung", "startup",
                     "other", "queueing"):
            seconds.add_metric([name], getattr(goodput, f"{name}_gpu_s"))
        ratio = GaugeMetricFamily("trainyard_goodput_ratio", "Productive / allocated GPU-time, all jobs.")
        ratio.add_metric([], goodput.goodput or 0.0)
        idle = GaugeMetricFamily("trainyard_reservation_idle_gpu_seconds",
                                 "GPU-seconds the scheduler held idle on purpose.", labels=["kind"])
        idle.add_metric(["job"], goodput.reservation_idle_gpu_s)
        idle.add_metric(["recovery-reserve"], goodput.recovery_reserve_idle_gpu_s)
        recoveries = CounterMetricFamily("trainyard_recoveries", "Recoveries: attempts after a failed one.")
        recoveries.add_metric([], goodput.recoveries)
        return [jobs, queue, oldest, leases, nodes, checkpoints, failed, stragglers, seconds, ratio, idle, recoveries]


class LaneCollector(Collector):
    """This replica's request lanes (control_plane/lanes.py), read at scrape time: sum across replicas."""

    def __init__(self, figures: Callable[[], Any]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Any]:
        f = self._figures()
        in_flight = GaugeMetricFamily("trainyard_lane_in_flight", "Requests being served, by lane.", labels=["lane"])
        in_flight.add_metric(["liveness"], f.liveness_in_flight)
        in_flight.add_metric(["bookkeeping"], f.bookkeeping_in_flight)
        yield in_flight
        queued = GaugeMetricFamily("trainyard_lane_queued", "Requests waiting for their lane's gate.", labels=["lane"])
        queued.add_metric(["liveness"], 0)  # liveness never waits for a gate
        queued.add_metric(["bookkeeping"], f.bookkeeping_queued)
        yield queued
        yield GaugeMetricFamily("trainyard_lane_liveness_oldest_seconds",
                                "How long the oldest unanswered liveness request has been here.",
                                value=f.liveness_oldest_s)
        total = CounterMetricFamily("trainyard_lane_requests", "Requests that entered each lane.", labels=["lane"])
        total.add_metric(["liveness"], f.liveness_total)
        total.add_metric(["bookkeeping"], f.bookkeeping_total)
        yield total
        waits = CounterMetricFamily("trainyard_lane_waits", "Requests that had to wait for their lane's gate.",
                                    labels=["lane"])
        waits.add_metric(["liveness"], 0)
        waits.add_metric(["bookkeeping"], f.bookkeeping_waits)
        yield waits
        yield CounterMetricFamily("trainyard_lane_wait_seconds", "Time bookkeeping requests waited for the gate.",
                                  value=f.bookkeeping_wait_seconds)
        yield CounterMetricFamily("trainyard_lane_refused", "Bookkeeping requests answered 503 by the gate.",
                                  value=f.bookkeeping_refused)


class Exporter:
    """What GET /metrics answers: this process's histograms, its lanes and the database's figures."""

    def __init__(self, factory: sessionmaker[Session], cache_s: float,
                 cluster_goodput: Callable[[Session], Any], lanes: Callable[[], Any] | None = None) -> None:
        self._database = CollectorRegistry(auto_describe=False)
        self._database.register(DatabaseCollector(factory, cache_s, cluster_goodput))
        self._lanes = CollectorRegistry(auto_describe=False)
        if lanes is not None:
            self._lanes.register(LaneCollector(lanes))

    def render(self) -> tuple[bytes, str]:
        body = generate_latest(PROCESS) + generate_latest(self._lanes) + generate_latest(self._database)
        return body, CONTENT_TYPE_LATEST
