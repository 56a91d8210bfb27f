"""Scheduler at cluster scale: the real control plane and PostgreSQL, simulated agents and time.

    .venv/bin/python bench/scheduler.py            # all scenarios, full scale (20-30 minutes on 2 cores)
    .venv/bin/python bench/scheduler.py --quick    # a smoke run (1-2 minutes)
    .venv/bin/python bench/scheduler.py --scenarios mixed          # one scenario

Three scenarios, each run three times in the same process on the same seeded job stream: with the
fair policy (reservations, backfill, scored placement) and with the two baselines, strict FIFO
(head-of-line blocking) and greedy first fit without reservations (large gangs can starve); the
baselines place by first fit (the first GPU kind that holds the job, the fullest nodes first).
``--policies`` also takes greedy-scored: greedy with the fair policy's placement.

- backlog: 1,000 nodes x 8 GPUs, 10,000 jobs queued at once; gang sizes 1 to 128 GPUs,
  heavy-tailed; log-normal run times (median 20 min, up to 12 h); 90% of the jobs have a time
  limit 1.1-3x their run time. The figures at scale: pass latency, admission rate, utilization,
  queueing delay by gang size.
- stream: 64 nodes x 8 GPUs fed a continuous stream of 1-GPU jobs (offered load 1.1 for 3 h)
  while 64-GPU gangs arrive every 75 min: does a large gang wait forever behind small ones?
- mixed: a real, mixed cluster (bench/mixed_cluster.py): 1,200 nodes of 1-8 GPUs, six GPU kinds
  from 2,720 GPUs down to 24, a third of the jobs constrained to one kind or several, run times
  from minutes to months, bursts that queue over ten thousand jobs, offered load 1.15 over a
  2-hour window, simulated to 12 h. Figures: utilization while jobs wait, waits by size and by
  constraint, jobs never started, pass latency, and the job-hours a job constrained to some kinds
  waited while GPUs of one of them sat idle where it fit, or were held by flexible jobs that
  could have run on another kind (split: those that took GPUs a waiting job constrained to that
  kind could use then, which a pass could have avoided, and the others, which only preemption
  could undo).

What is real: nodes register through ``services.cluster.nodes.register``; every scheduling pass is
``scheduler.allocate.schedule_pass`` (advisory lock, queue and capacity reads, the pure policy,
bulk attempt/lease inserts, reservation accounting) on an embedded PostgreSQL, timed by the wall
clock, with the ``PendingCache`` the control plane's scheduler loop keeps between passes (the first
pass reads every waiting job in full); the time-limit loop runs before each pass. What is
simulated: time (``control_plane.clock.use_clock``; a pass every ``--tick`` simulated seconds) and the
agents: when an attempt's run time is over, the bench ends it through the services an agent's
reports reach (``end_attempt``, the job to succeeded, ``release_parts`` of its nodes), so leases come
back as they would. Jobs are inserted as queued rows when they arrive, the way submit writes them
(not timed; after the bulk load of the backlog the bench runs ANALYZE, as autovacuum would
shortly). Like the control plane once started (app.py), the bench freezes its startup heap for the
garbage collector.

It prints a table per scenario with ratios to the baselines, then the targets. Timings are
printed, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import math
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, insert, select, text  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from bench import mixed_cluster as mixed  # noqa: E402
from control_plane.clock import use_clock  # noqa: E402
from control_plane.db import make_engine, make_session_factory, run_migrations  # noqa: E402
from control_plane.logging import configure_logging  # noqa: E402
from control_plane.models import Attempt, AttemptPart, Job, Node  # noqa: E402
from control_plane.models import Reservation as ReservationRow  # noqa: E402
from control_plane.scheduler.allocate import PendingCache, schedule_pass  # noqa: E402
from control_plane.scheduler.model import Mode, PlacementRule  # noqa: E402
from control_plane.services.cluster import nodes, reservations  # noqa: E402
from control_plane.services.runs import attempts, limits  # noqa: E402
from control_plane.services.runs.jobs import set_job_state  # noqa: E402
from control_plane.settings import Settings  # noqa: E402
from trainyard.embedded import EmbeddedPostgres, PostgresAdmin  # noqa: E402
from trainyard.protocol.agent import GpuInfo, RegisterRequest  # noqa: E402

T0 = datetime(2026, 12, 2, tzinfo=UTC)
SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
WEIGHTS = (0.40, 0.15, 0.15, 0.15, 0.07, 0.04, 0.025, 0.015)  # heavy-tailed: few, very large gangs
SIZE_CLASSES = (("1", 1, 1), ("2-4", 2, 4), ("8", 8, 8), ("16-32", 16, 32), ("64-128", 64, 128))
TENANTS = (("research", 1.0), ("vision", 1.0), ("nlp", 2.0), ("prod", 4.0))
POLICIES = ("fair", "fifo", "greedy", "greedy-scored")
DEFAULT_POLICIES = ("fair", "fifo", "greedy")
PLACEMENT: dict[str, tuple[Mode, PlacementRule]] = {
    "fair": ("fair", "scored"), "fifo": ("fifo", "first-fit"), "greedy": ("greedy", "first-fit"),
    "greedy-scored": ("greedy", "scored")}
"""Policy name -> (mode, placement rule) of the pass."""
SCENARIOS = ("backlog", "stream", "mixed")


@dataclass(frozen=True)
class JobSpec:
    index: int
    gpus: int
    runtime_s: int
    time_limit_s: int | None
    tenant: str = "research"
    priority: int = 0
    arrival_s: float = 0.0
    kinds: tuple[str, ...] | None = None
    """The GPU kinds it accepts (None: any)."""

    @property
    def shape(self) -> tuple[int, int]:
        """(nodes, GPUs per node): whole 8-GPU nodes past 8 GPUs."""
        return (1, self.gpus) if self.gpus <= 8 else (self.gpus // 8, 8)

    @property
    def id(self) -> uuid.UUID:
        return uuid.uuid5(uuid.NAMESPACE_URL, f"bench-job-{self.index}")


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    nodes: int
    gpus_per_node: int
    rack_size: int
    specs: list[JobSpec]
    layout: list[mixed.NodeSpec] | None = None
    """Nodes of several sizes and kinds (None: ``nodes`` x ``gpus_per_node`` h100)."""
    horizon_s: float | None = None
    """Simulated time at which the run stops (None: once nothing waits or is to come)."""

    @property
    def gpus(self) -> int:
        if self.layout is not None:
            return sum(n.gpus for n in self.layout)
        return self.nodes * self.gpus_per_node

    def node_specs(self) -> list[mixed.NodeSpec]:
        if self.layout is not None:
            return self.layout
        return [mixed.NodeSpec(f"gpu-{i:04d}", self.gpus_per_node, "h100", f"r{i // self.rack_size:03d}")
                for i in range(self.nodes)]


def backlog(nodes: int, jobs: int, seed: int) -> Scenario:
    rnd = random.Random(seed)
    specs = []
    for i in range(jobs):
        gpus = min(rnd.choices(SIZES, WEIGHTS)[0], nodes * 8)
        runtime = int(min(max(60.0, rnd.lognormvariate(math.log(1200), 1.0)), 12 * 3600))
        limit = None if rnd.random() < 0.1 else int(math.ceil(runtime * rnd.uniform(1.1, 3.0) / 60) * 60)
        tenant = rnd.choices([t for t, _ in TENANTS], (0.4, 0.3, 0.2, 0.1))[0]
        specs.append(JobSpec(i, gpus, runtime, limit, tenant, 1 if rnd.random() < 0.02 else 0))
    return Scenario("backlog", f"{nodes} nodes x 8 GPUs, {jobs} jobs queued at once", nodes, 8, 32, specs)


def stream(nodes: int, hours: float, seed: int, load: float = 1.1) -> Scenario:
    rnd = random.Random(seed)
    median = 600.0  # 1-GPU jobs: log-normal run time, median 10 min; limits 1.1-2x the run time
    rate = load * nodes * 8 / (median * math.exp(0.8**2 / 2))
    specs, t, i = [], 0.0, 0
    while True:
        t += rnd.expovariate(rate)
        if t >= hours * 3600:
            break
        runtime = int(min(max(60.0, rnd.lognormvariate(math.log(median), 0.8)), 2 * 3600))
        specs.append(JobSpec(i, 1, runtime, int(math.ceil(runtime * rnd.uniform(1.1, 2.0) / 60) * 60), arrival_s=t))
        i += 1
    for k, at in enumerate(range(15 * 60, int(hours * 3600), 75 * 60)):  # 64-GPU gangs: 30 min, limit 45
        specs.append(JobSpec(i + k, 64, 1800, 2700, arrival_s=float(at)))
    return Scenario("stream", f"{nodes} nodes x 8 GPUs, 1-GPU jobs at load {load:g} for {hours:g} h, "
                    f"{len(specs) - i} 64-GPU gangs arriving", nodes, 8, 16, specs)


def mixed_scenario(scale: float, hours: float, horizon_h: float, seed: int, load: float = 1.15) -> Scenario:
    nodes = mixed.layout(scale)
    window = hours * 3600
    bursts = [(0.0, round(15000 * scale * hours / 2)), (window * 5 / 12, round(10000 * scale * hours / 2))]
    made = mixed.jobs(nodes, window_s=window, bursts=bursts, load=load, seed=seed)
    specs = [JobSpec(i, j.gpus, j.runtime_s, j.time_limit_s, j.tenant, j.priority, j.arrival_s, j.kinds)
             for i, j in enumerate(made)]
    kinds = Counter(n.kind for n in nodes for _ in range(n.gpus))
    title = (f"{len(nodes)} nodes of 1-8 GPUs ({', '.join(f'{k} {v}' for k, v in kinds.most_common())} GPUs), "
             f"{len(specs)} jobs over {hours:g} h, offered load {mixed.offered_load(nodes, made, window):.2f}, "
             f"to {horizon_h:g} h")
    return Scenario("mixed", title, len(nodes), 8, mixed.RACK_SIZE, specs, layout=nodes,
                    horizon_s=horizon_h * 3600)


class SimClock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> datetime:
        return self.t


@dataclass
class Result:
    policy: str
    pass_ms: list[float] = field(default_factory=list)
    admitted_per_pass: list[int] = field(default_factory=list)
    starts: dict[int, float] = field(default_factory=dict)  # job index -> simulated start (s)
    busy_gpu_s_waiting: float = 0.0  # GPUs busy x time, while some job waited
    waiting_s: float = 0.0  # simulated time while some job waited
    reservation_idle_gpu_s: float = 0.0
    reservations_started: int = 0
    reservations_on_time: int = 0
    unfinished: int = 0
    failed: int = 0
    wall_s: float = 0.0
    waiting_at_pass: list[int] = field(default_factory=list)  # jobs waiting when each pass ran
    idle_job_s: float = 0.0  # mixed: see mixed_cluster.KindLedger
    reserved_job_s: float = 0.0
    movable_job_s: float = 0.0
    unclaimed_job_s: float = 0.0
    end_s: float = 0.0  # simulated time when the run stopped


BENCH_JOIN_TOKEN = "bench-join-token"
"""The static join token the bench's nodes register with (the control plane's TRAINYARD_JOIN_TOKEN)."""


def build_template(pg: PostgresAdmin, name: str, sc: Scenario) -> None:
    """A migrated database with the scenario's nodes registered (jobs come during the run)."""
    url = pg.create_database(name)
    run_migrations(url)
    engine = make_engine(url, pool_size=2)
    factory = make_session_factory(engine)
    use_clock(lambda: T0 - timedelta(seconds=1))
    for i, spec in enumerate(sc.node_specs()):
        with factory() as s:
            nodes.register(s, RegisterRequest(
                name=spec.name, address=f"10.{i // 250}.{i % 250}.1", agent_version="bench",
                gpus=[GpuInfo(index=g, uuid=f"{spec.name}-{g}", kind=spec.kind, memory_mb=81559)
                      for g in range(spec.gpus)],
                labels={"rack": spec.rack},
            ), BENCH_JOIN_TOKEN, static_join_token=BENCH_JOIN_TOKEN)
    engine.dispose()
    use_clock(None)
    pg.mark_template(name)


def submit(session: Session, specs: list[JobSpec]) -> None:
    """Queued job rows, as submit writes them (bulk: the submit path is not what is measured)."""
    rows = []
    for spec in specs:
        n, g = spec.shape
        at = T0 + timedelta(seconds=spec.arrival_s, microseconds=spec.index)
        rows.append({
            "id": spec.id, "name": f"job-{spec.index}", "principal": "bench", "tenant": spec.tenant,
            "priority": spec.priority, "state": "queued", "num_nodes": n, "gpus_per_node": g,
            "gpu_kinds": list(spec.kinds) if spec.kinds else None,
            "entrypoint": "bench.simulated", "args": [], "env": {}, "checkpoint": {}, "max_failures": 0,
            "failures": 0, "time_limit_s": spec.time_limit_s, "created_at": at, "updated_at": at,
        })
    for start in range(0, len(rows), 2000):
        session.execute(insert(Job), rows[start:start + 2000])
    session.commit()


def finish(session: Session, attempt_ids: list[uuid.UUID]) -> None:
    """The simulated agents: every worker exited 0, then every node's processes are gone. The rows
    are read (and locked) in three queries; each attempt ends through end_attempt, set_job_state and
    release_parts, as an agent's reports make it end."""
    found = {a.id: a for a in session.scalars(
        select(Attempt).where(Attempt.id.in_(attempt_ids)).with_for_update())}
    jobs = {j.id: j for j in session.scalars(
        select(Job).where(Job.id.in_([a.job_id for a in found.values()])).with_for_update())}
    parts: dict[uuid.UUID, list[AttemptPart]] = defaultdict(list)
    for part in session.scalars(select(AttemptPart).where(AttemptPart.attempt_id.in_(attempt_ids))):
        parts[part.attempt_id].append(part)
    for attempt_id in attempt_ids:
        attempt = found[attempt_id]
        attempts.end_attempt(session, attempt, outcome="succeeded", reason="simulated run finished")
        set_job_state(session, jobs[attempt.job_id], "succeeded", f"attempt {attempt.number} finished")
        attempts.release_parts(session, [part.id for part in parts[attempt_id]])
    session.commit()


def simulate(policy: str, url: str, sc: Scenario, args: argparse.Namespace) -> Result:
    result = Result(policy)
    clock = SimClock()
    use_clock(clock)
    settings = Settings(database_url=url, run_loops=False, log_json=False, max_reservations=args.max_reservations,
                        topology_label="rack", recovery_reserve_nodes=0)
    mode, placement = PLACEMENT[policy]
    engine = make_engine(url, pool_size=2)
    factory = make_session_factory(engine)
    by_id = {s.id: s for s in sc.specs}
    ledger = None
    if sc.layout is not None:  # which node is which: the ledger follows them by id
        ledger = mixed.KindLedger()
        specs = {n.name: n for n in sc.layout}
        with factory() as s:
            for node_id, name in s.execute(select(Node.id, Node.name)):
                ledger.add_node(str(node_id), specs[name].kind, specs[name].gpus)
    cache = PendingCache()  # what the control plane's scheduler loop keeps between passes (loops.py)
    arrivals = deque(sorted(sc.specs, key=lambda s: (s.arrival_s, s.index)))
    ends: list[tuple[float, uuid.UUID, int, int]] = []  # (end time, attempt, GPUs, job index)
    waiting: dict[int, JobSpec] = {}
    busy = 0
    t = 0.0
    wall0 = time.perf_counter()
    while (arrivals or waiting) and (sc.horizon_s is None or t < sc.horizon_s):
        clock.t = T0 + timedelta(seconds=t)
        due = []
        while arrivals and arrivals[0].arrival_s <= t:
            due.append(arrivals.popleft())
        if due:
            with factory() as s:
                submit(s, due)
                if len(due) >= 1000:
                    # A bulk load into a copy of an empty template: refresh the planner's statistics,
                    # as autovacuum would shortly (untimed).
                    s.execute(text("ANALYZE"))
                    s.commit()
            waiting.update((spec.index, spec) for spec in due)
        done = []
        while ends and ends[0][0] <= t:
            _, attempt_id, gpus, index = heapq.heappop(ends)
            done.append(attempt_id)
            busy -= gpus
            if ledger is not None:
                ledger.ended(index)
        if done:
            with factory() as s:
                finish(s, done)
        with factory() as s:
            limits.enforce_time_limits(s)
            s.commit()
        result.waiting_at_pass.append(len(waiting))
        with factory() as s:
            started = time.perf_counter()
            placed = schedule_pass(s, settings, mode=mode, placement=placement, cache=cache)
            result.pass_ms.append((time.perf_counter() - started) * 1000)
        result.admitted_per_pass.append(len(placed))
        if placed:
            with factory() as s:
                current = dict(s.execute(select(Job.id, Job.current_attempt_id).where(
                    Job.id.in_([uuid.UUID(p.job_id) for p in placed]))).all())
            for p in placed:
                spec = by_id[uuid.UUID(p.job_id)]
                result.starts[spec.index] = t
                placed_attempt = current[spec.id]
                assert placed_attempt is not None, "a placed job has a current attempt"
                heapq.heappush(ends, (t + spec.runtime_s, placed_attempt, spec.gpus, spec.index))
                busy += spec.gpus
                del waiting[spec.index]
        if ledger is not None:
            with factory() as s:  # what the reservations hold after the pass (not timed)
                ledger.reserved(str(n) for (ids,) in s.execute(
                    select(ReservationRow.node_ids).where(ReservationRow.ended_at.is_(None))) for n in ids)
            ledger.placed([(by_id[uuid.UUID(p.job_id)].index, _as_mixed(by_id[uuid.UUID(p.job_id)]), p.gpu_kind,
                            [(nid, len(ix)) for nid, ix in p.nodes]) for p in placed],
                          (_as_mixed(spec) for spec in waiting.values()))
        if waiting and not ends and not arrivals:
            result.unfinished = len(waiting)  # nothing runs, nothing comes, and nothing fits: the table says so
            break
        if waiting:
            result.busy_gpu_s_waiting += busy * args.tick
            result.waiting_s += args.tick
            if ledger is not None:
                ledger.account((_as_mixed(spec) for spec in waiting.values()), args.tick)
        t += args.tick
    result.wall_s = time.perf_counter() - wall0
    result.end_s = t
    if ledger is not None:
        result.idle_job_s, result.reserved_job_s = ledger.idle_job_s, ledger.reserved_job_s
        result.movable_job_s, result.unclaimed_job_s = ledger.movable_job_s, ledger.unclaimed_job_s
    clock.t = T0 + timedelta(seconds=t)
    with factory() as s:
        summary = reservations.summary(s)
        result.failed = s.scalar(select(func.count()).select_from(Job).where(Job.state == "failed")) or 0
    result.reservation_idle_gpu_s = summary.reservation_idle_gpu_seconds
    result.reservations_started = summary.reservations_started
    result.reservations_on_time = summary.reservations_started_on_time
    engine.dispose()
    use_clock(None)
    return result


def _as_mixed(spec: JobSpec) -> mixed.MixedJob:
    return mixed.MixedJob(spec.gpus, spec.runtime_s, spec.time_limit_s, spec.kinds, spec.tenant, spec.priority,
                          spec.arrival_s)


# -- figures ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def metrics(r: Result, sc: Scenario) -> dict[str, float]:
    specs = [s for s in sc.specs if s.index in r.starts]
    wait = {s.index: r.starts[s.index] - s.arrival_s for s in specs}
    by_class: dict[str, list[float]] = defaultdict(list)
    for s in specs:
        for name, lo, hi in SIZE_CLASSES:
            if lo <= s.gpus <= hi:
                by_class[name].append(wait[s.index])
    largest = max(s.gpus for s in sc.specs)
    # Starvation: how many jobs submitted after a largest-size job started before it.
    order = {s.index: i for i, s in enumerate(sorted(sc.specs, key=lambda s: (s.arrival_s, s.index)))}
    by_start = sorted(specs, key=lambda s: (r.starts[s.index], order[s.index]))
    overtaken = []
    for pos, s in enumerate(by_start):
        if s.gpus == largest:
            overtaken.append(sum(1 for o in by_start[:pos] if order[o.index] > order[s.index]))
    # Pass time = fixed cost + marginal cost per admitted gang (least squares over all passes).
    n = len(r.pass_ms)
    mean_a, mean_ms = sum(r.admitted_per_pass) / n, sum(r.pass_ms) / n
    var = sum((a - mean_a) ** 2 for a in r.admitted_per_pass)
    slope = (sum((a - mean_a) * (ms - mean_ms) for a, ms in zip(r.admitted_per_pass, r.pass_ms, strict=True)) / var
             if var else float("nan"))
    makespan = max((r.starts[s.index] + s.runtime_s for s in specs), default=0.0)
    work = sum(s.gpus * s.runtime_s for s in specs)
    out = {
        "pass_p50_ms": statistics.median(r.pass_ms),
        "pass_p99_ms": pct(r.pass_ms, 0.99),
        "pass_max_ms": max(r.pass_ms),
        "passes": n,
        "burst_gangs": r.admitted_per_pass[0],
        "burst_ms": r.pass_ms[0],
        "burst_admissions_per_s": r.admitted_per_pass[0] / (r.pass_ms[0] / 1000),
        "marginal_ms_per_gang": slope,
        "marginal_admissions_per_s": 1000 / slope if slope and slope > 0 else float("nan"),
        "fixed_pass_ms": mean_ms - slope * mean_a,
        "util_while_waiting": r.busy_gpu_s_waiting / (sc.gpus * r.waiting_s) if r.waiting_s else float("nan"),
        "util_makespan": work / (sc.gpus * makespan) if makespan else float("nan"),
        "makespan_h": makespan / 3600,
        "largest_wait_max_h": max((wait[s.index] for s in specs if s.gpus == largest), default=math.nan) / 3600,
        "largest_wait_mean_h": statistics.fmean([wait[s.index] for s in specs if s.gpus == largest]) / 3600,
        "largest_overtaken_mean": statistics.fmean(overtaken) if overtaken else 0.0,
        "largest_overtaken_max": max(overtaken, default=0),
        "reservation_idle_gpu_h": r.reservation_idle_gpu_s / 3600,
        "reservation_idle_pct": 100 * r.reservation_idle_gpu_s / (sc.gpus * makespan) if makespan else 0.0,
        "reservations_started": r.reservations_started,
        "reservations_on_time": r.reservations_on_time,
        "unfinished": r.unfinished + len(sc.specs) - len(specs),
        "failed": r.failed,
        "wall_s": r.wall_s,
    }
    for name, _, _ in SIZE_CLASSES:
        w = by_class.get(name, [])
        out[f"wait_mean_h[{name}]"] = statistics.fmean(w) / 3600 if w else float("nan")
        out[f"wait_p95_h[{name}]"] = pct(w, 0.95) / 3600
    return out


ROWS = [
    ("pass_p50_ms", "scheduling pass, median (ms)", "{:.1f}"),
    ("pass_p99_ms", "scheduling pass, p99 (ms)", "{:.1f}"),
    ("pass_max_ms", "scheduling pass, max (ms)", "{:.1f}"),
    ("passes", "passes", "{:.0f}"),
    ("burst_gangs", "gangs admitted by the first pass", "{:.0f}"),
    ("burst_ms", "... in (ms)", "{:.0f}"),
    ("burst_admissions_per_s", "gang admissions / s (first pass)", "{:.0f}"),
    ("marginal_ms_per_gang", "marginal pass cost per gang (ms, fit)", "{:.2f}"),
    ("marginal_admissions_per_s", "gang admissions / s (marginal, fit)", "{:.0f}"),
    ("fixed_pass_ms", "fixed pass cost (ms, fit)", "{:.1f}"),
    ("util_while_waiting", "GPU utilization while jobs wait", "{:.1%}"),
    ("util_makespan", "GPU utilization to the last job's end", "{:.1%}"),
    ("makespan_h", "makespan (h)", "{:.2f}"),
    *[(f"wait_mean_h[{n}]", f"queueing delay mean, {n} GPUs (h)", "{:.2f}") for n, _, _ in SIZE_CLASSES],
    *[(f"wait_p95_h[{n}]", f"queueing delay p95, {n} GPUs (h)", "{:.2f}") for n, _, _ in SIZE_CLASSES],
    ("largest_wait_max_h", "largest jobs' wait, max (h)", "{:.2f}"),
    ("largest_wait_mean_h", "largest jobs' wait, mean (h)", "{:.2f}"),
    ("largest_overtaken_mean", "largest jobs: later jobs started first, mean", "{:.0f}"),
    ("largest_overtaken_max", "largest jobs: later jobs started first, max", "{:.0f}"),
    ("reservation_idle_gpu_h", "reservation idle cost (GPU-h)", "{:.1f}"),
    ("reservation_idle_pct", "reservation idle cost (% of GPU time)", "{:.2f}"),
    ("reservations_started", "reserved jobs started", "{:.0f}"),
    ("reservations_on_time", "... by their first earliest start", "{:.0f}"),
    ("unfinished", "jobs never placed", "{:.0f}"),
    ("failed", "jobs failed (none should: run time < limit)", "{:.0f}"),
    ("wall_s", "simulation wall time (s)", "{:.0f}"),
]


def mixed_metrics(r: Result, sc: Scenario) -> dict[str, float]:
    """The mixed scenario's figures: a job not started by the end waited until then (censored)."""
    started = [s for s in sc.specs if s.index in r.starts]
    wait = {s.index: r.starts.get(s.index, r.end_s) - s.arrival_s for s in sc.specs if s.arrival_s <= r.end_s}
    deep = [ms for ms, w in zip(r.pass_ms, r.waiting_at_pass, strict=True) if w >= 10_000]
    out: dict[str, float] = {
        "pass_p50_ms": statistics.median(r.pass_ms),
        "pass_p99_ms": pct(r.pass_ms, 0.99),
        "pass_p99_deep_ms": pct(deep, 0.99),
        "pass_max_ms": max(r.pass_ms),
        "passes": len(r.pass_ms),
        "waiting_max": max(r.waiting_at_pass),
        "util_while_waiting": r.busy_gpu_s_waiting / (sc.gpus * r.waiting_s) if r.waiting_s else float("nan"),
        "never_started": len(sc.specs) - len(started),
        "idle_job_h": r.idle_job_s / 3600,
        "reserved_job_h": r.reserved_job_s / 3600,
        "movable_job_h": r.movable_job_s / 3600,
        "unclaimed_job_h": r.unclaimed_job_s / 3600,
        "reservation_idle_gpu_h": r.reservation_idle_gpu_s / 3600,
        "reservation_idle_pct": 100 * r.reservation_idle_gpu_s / (sc.gpus * r.end_s) if r.end_s else 0.0,
        "reservations_started": r.reservations_started,
        "reservations_on_time": r.reservations_on_time,
        "failed": r.failed,
        "wall_s": r.wall_s,
    }
    for name, lo, hi in mixed.SIZE_CLASSES:
        w = [wait[s.index] for s in started if lo <= s.gpus <= hi]
        out[f"wait_mean_h[{name}]"] = statistics.fmean(w) / 3600 if w else float("nan")
        out[f"wait_p95_h[{name}]"] = pct(w, 0.95) / 3600
        out[f"never[{name}]"] = sum(1 for s in sc.specs if lo <= s.gpus <= hi and s.index not in r.starts)
    for name in mixed.CONSTRAINT_CLASSES:
        jobs = [s for s in sc.specs if mixed.constraint_class(s.kinds) == name]
        w = [wait[s.index] for s in jobs if s.index in wait]
        out[f"cwait_mean_h[{name}]"] = statistics.fmean(w) / 3600 if w else float("nan")
        out[f"cnever[{name}]"] = sum(1 for s in jobs if s.index not in r.starts)
        out[f"cjobs[{name}]"] = len(jobs)
    return out


MIXED_ROWS = [
    ("pass_p50_ms", "scheduling pass, median (ms)", "{:.1f}"),
    ("pass_p99_ms", "scheduling pass, p99 (ms)", "{:.1f}"),
    ("pass_p99_deep_ms", "... p99 with >= 10,000 jobs waiting (ms)", "{:.1f}"),
    ("pass_max_ms", "scheduling pass, max (ms)", "{:.1f}"),
    ("passes", "passes", "{:.0f}"),
    ("waiting_max", "jobs waiting, most at a pass", "{:.0f}"),
    ("util_while_waiting", "GPU utilization while jobs wait", "{:.1%}"),
    *[(f"wait_mean_h[{n}]", f"queueing delay mean, {n} GPUs, started (h)", "{:.2f}")
      for n, _, _ in mixed.SIZE_CLASSES],
    *[(f"wait_p95_h[{n}]", f"queueing delay p95, {n} GPUs, started (h)", "{:.2f}") for n, _, _ in mixed.SIZE_CLASSES],
    *[(f"never[{n}]", f"never started, {n} GPUs", "{:.0f}") for n, _, _ in mixed.SIZE_CLASSES],
    *[(f"cwait_mean_h[{n}]", f"wait mean, {n} (h, to the end if never started)", "{:.2f}")
      for n in mixed.CONSTRAINT_CLASSES],
    *[(f"cnever[{n}]", f"never started, {n}", "{:.0f}") for n in mixed.CONSTRAINT_CLASSES],
    ("never_started", "jobs never started", "{:.0f}"),
    ("idle_job_h", "constrained waits beside idle GPUs that fit (job-h)", "{:.1f}"),
    ("reserved_job_h", "... beside idle GPUs of reserved nodes (job-h)", "{:.1f}"),
    ("movable_job_h", "... beside GPUs of movable flexible jobs (job-h)", "{:.1f}"),
    ("unclaimed_job_h", "... beside flexible jobs on GPUs none waiting could use (job-h)", "{:.1f}"),
    ("reservation_idle_gpu_h", "reservation idle cost (GPU-h)", "{:.1f}"),
    ("reservation_idle_pct", "reservation idle cost (% of GPU time)", "{:.2f}"),
    ("reservations_started", "reserved jobs started", "{:.0f}"),
    ("reservations_on_time", "... by their first earliest start", "{:.0f}"),
    ("failed", "jobs failed (none should: run time < limit)", "{:.0f}"),
    ("wall_s", "simulation wall time (s)", "{:.0f}"),
]


def table(sc: Scenario, results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    names = list(results)
    rows = MIXED_ROWS if sc.layout is not None else ROWS
    print(f"\n== {sc.name}: {sc.title} (seed {args.seed}, a pass every {args.tick:g} simulated s, "
          f"max_reservations={args.max_reservations})\n")
    ratio_cols = [b for b in ("fifo", "greedy") if b in results and "fair" in results]
    header = f"{'metric':56}" + "".join(f"{n:>14}" for n in names) + "".join(f"{'fair/' + b:>13}" for b in ratio_cols)
    print(header)
    print("-" * len(header))
    for key, label, fmt in rows:
        values = [results[n][key] for n in names]
        if all(isinstance(v, float) and math.isnan(v) for v in values):
            continue
        line = f"{label:56}" + "".join(f"{fmt.format(v):>14}" for v in values)
        for b in ratio_cols:
            base, fair = results[b][key], results["fair"][key]
            ok = base and not (math.isnan(base) or math.isnan(fair))
            line += f"{(fair / base):>13.2f}" if ok else f"{'':>13}"
        print(line)


def targets(all_results: dict[str, dict[str, dict[str, float]]]) -> None:
    print("\ntargets (fair policy):")
    back = all_results.get("backlog", {})
    if "fair" in back:
        fair = back["fair"]
        print(f"  backlog: p99 pass < 250 ms: {fair['pass_p99_ms']:.1f} ms -> "
              f"{'met' if fair['pass_p99_ms'] < 250 else 'MISSED'}")
        rate = fair["burst_admissions_per_s"]
        print(f"  backlog: >= 500 gang admissions/s: {rate:.0f}/s in the first pass ({fair['burst_gangs']:.0f} gangs), "
              f"{fair['marginal_admissions_per_s']:.0f}/s marginal -> {'met' if rate >= 500 else 'MISSED'}")
    for name, res in all_results.items():
        if name == "mixed":
            continue
        if "fair" in res and "greedy" in res:
            gap = 100 * (res["greedy"]["util_while_waiting"] - res["fair"]["util_while_waiting"])
            print(f"  {name}: utilization within 5 points of greedy first fit: {gap:+.1f} points behind -> "
                  f"{'met' if gap <= 5 else 'MISSED'}")
            others = ", ".join(f"{p} {res[p]['largest_wait_max_h']:.2f} h" for p in ("greedy", "fifo") if p in res)
            print(f"  {name}: largest jobs' longest wait {res['fair']['largest_wait_max_h']:.2f} h ({others})")
    mix = all_results.get("mixed", {})
    if "fair" in mix:
        fair = mix["fair"]
        print(f"  mixed: p99 pass < 250 ms: {fair['pass_p99_ms']:.1f} ms ({fair['pass_p99_deep_ms']:.1f} ms with "
              f">= 10,000 waiting, up to {fair['waiting_max']:.0f}) -> "
              f"{'met' if fair['pass_p99_ms'] < 250 else 'MISSED'}")
        if "greedy" in mix:
            greedy = mix["greedy"]["util_while_waiting"]
            print(f"  mixed: utilization while jobs wait at least greedy's: {fair['util_while_waiting']:.1%} vs "
                  f"{greedy:.1%} -> {'met' if fair['util_while_waiting'] >= greedy else 'MISSED'}")
        lost = fair["idle_job_h"] + fair["movable_job_h"]
        print(f"  mixed: no constrained job waits beside idle GPUs of its kind or GPUs held by flexible jobs that "
              f"could have run elsewhere: {fair['idle_job_h']:.2f} + {fair['movable_job_h']:.2f} job-h -> "
              f"{'met' if lost == 0 else 'MISSED'} (not counted, as no pass could have avoided it without "
              f"preempting: {fair['unclaimed_job_h']:.1f} job-h beside flexible jobs that took only GPUs no "
              f"waiting job constrained to that kind could use then)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: backlog,stream,mixed")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated: fair,fifo,greedy,greedy-scored")
    parser.add_argument("--nodes", type=int, default=1000, help="backlog: nodes (8 GPUs each)")
    parser.add_argument("--jobs", type=int, default=10_000, help="backlog: jobs queued at once")
    parser.add_argument("--stream-nodes", type=int, default=64, help="stream: nodes (8 GPUs each)")
    parser.add_argument("--stream-hours", type=float, default=3.0, help="stream: how long 1-GPU jobs arrive")
    parser.add_argument("--mixed-scale", type=float, default=1.0,
                        help="mixed: nodes and bursts x this (1: 1,200 nodes)")
    parser.add_argument("--mixed-hours", type=float, default=2.0, help="mixed: how long jobs arrive")
    parser.add_argument("--mixed-horizon", type=float, default=12.0, help="mixed: simulated hours until the run stops")
    parser.add_argument("--tick", type=float, default=60.0, help="simulated seconds between passes")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-reservations", type=int, default=Settings.model_fields["max_reservations"].default)
    parser.add_argument("--quick", action="store_true",
                        help="backlog: 100 nodes, 1,000 jobs; stream: 16 nodes, 1 h; mixed: 1/8 scale, 1 h, to 3 h")
    parser.add_argument("--database-url", help="superuser URL of a PostgreSQL to use instead of an embedded one")
    args = parser.parse_args()
    if args.quick:
        args.nodes, args.jobs, args.stream_nodes, args.stream_hours = 100, 1000, 16, 1.0
        args.mixed_scale, args.mixed_hours, args.mixed_horizon = 0.125, 1.0, 3.0
    policies = [p for p in args.policies.split(",") if p]
    scenarios = [s for s in args.scenarios.split(",") if s]
    if any(p not in POLICIES for p in policies) or any(s not in SCENARIOS for s in scenarios):
        parser.error(f"choose --policies among {', '.join(POLICIES)} and --scenarios among {', '.join(SCENARIOS)}")
    configure_logging(json=False, level="WARNING")
    tmp = Path(tempfile.mkdtemp(prefix="trainyard-bench-"))
    pg: PostgresAdmin = PostgresAdmin(args.database_url) if args.database_url else EmbeddedPostgres(tmp / "pg")
    all_results: dict[str, dict[str, dict[str, float]]] = {}
    templates: list[str] = []
    try:
        for which in scenarios:
            sc = (backlog(args.nodes, args.jobs, args.seed) if which == "backlog"
                  else stream(args.stream_nodes, args.stream_hours, args.seed) if which == "stream"
                  else mixed_scenario(args.mixed_scale, args.mixed_hours, args.mixed_horizon, args.seed))
            template = f"bench_{which}_{uuid.uuid4().hex[:8]}"
            print(f"{which}: registering {sc.nodes} nodes, {len(sc.specs)} jobs to come ...", flush=True)
            build_template(pg, template, sc)
            templates.append(template)
            gc.freeze()  # as the control plane does once started (app.py): passes do not walk this heap
            results = all_results[which] = {}
            for policy in policies:
                name = f"bench_{which}_{policy}_{uuid.uuid4().hex[:6]}"
                url = pg.create_database(name, template=template)
                try:
                    r = simulate(policy, url, sc, args)
                finally:
                    pg.drop_database(name)
                results[policy] = mixed_metrics(r, sc) if sc.layout is not None else metrics(r, sc)
                print(f"  {policy}: {len(r.pass_ms)} passes, p99 {results[policy]['pass_p99_ms']:.1f} ms, "
                      f"{r.wall_s:.0f} s", flush=True)
            table(sc, results, args)
        targets(all_results)
    finally:
        for template in templates:
            pg.drop_database(template)
        if isinstance(pg, EmbeddedPostgres):
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
