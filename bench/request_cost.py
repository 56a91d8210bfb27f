"""Control-plane CPU per agent request (issue 27): what one heartbeat, status report, shard report,
storage grant and upload-slot request costs the control plane, in CPU milliseconds and SQL
statements, beside a baseline request measured in the same run (``GET /healthz``: the HTTP stack
alone).

    .venv/bin/python bench/request_cost.py [--nodes 4] [--requests 200]

Starts embedded PostgreSQL and S3 (SeaweedFS), a ``trainyard server`` subprocess on them (plain HTTP,
one replica) and ``--nodes`` simulated agents of 8 GPU slots (trainyard/dev/fleet.py) whose
heartbeat loops are paused, then submits one job on every node. Each kind of request is then sent
``--requests`` times, one after the other, by node rank 0's agent, and the control plane's CPU is read
from /proc/<pid>/stat (user + system) before and after: CPU per request = the difference over the
count. SQL statements per request come from PostgreSQL's own log (``log_statement = all`` while the
requests run, between marker queries). The agent's side (httpx in this process) is not counted.

Kinds: ``healthz`` (baseline), ``heartbeat`` (a node holding one attempt, delta protocol),
``status`` (an unchanged running status), ``storage`` (a PUT grant of one rank's shard),
``slot`` (an upload slot, asked with ``wait_s`` 0 and released: two requests), ``checkpoint`` (every
node reports its 8 shards of a new step, at once; the last report commits it: per node report).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev.fleet import AGENT, ControlPlane, Fleet, S3Target, SimAgent, SimRun  # noqa: E402
from trainyard.protocol.keys import job_checkpoint_prefix, shard_key  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
KINDS = ("healthz", "heartbeat", "status", "storage", "slot", "checkpoint")
OPEN_STEP = 500
"""The step of the storage grants and slots asked for: a save in flight that is never reported (a save
per request would reach the attempt's bound on saves in flight)."""


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Kinds:
    """One coroutine per kind of request; each call sends that request once (or a pair, for a slot)."""

    def __init__(self, fleet: Fleet, agent: SimAgent, run: SimRun) -> None:
        self.fleet, self.agent, self.run = fleet, agent, run
        self.spec = run.spec
        self.step = 1_000

    def _body(self, **extra: Any) -> dict[str, Any]:
        return {"fencing_token": self.spec["fencing_token"], "node_rank": self.spec["node_rank"], **extra}

    def _ok(self, r: Any, what: str) -> Any:
        if r.status_code >= 400:
            raise RuntimeError(f"{what}: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    async def healthz(self) -> None:
        r = await self.agent.http.get("/healthz")
        r.raise_for_status()

    async def heartbeat(self) -> None:
        await self.agent.heartbeat()

    async def status(self) -> None:
        await self.agent.status(self.run, "running", workers=self.run.workers("running"))

    async def checkpoint(self) -> None:
        """Every node's shards of a new step, uploaded (not measured: S3's CPU), then each node's report;
        the last one commits the step. Counted as one request per node (``per`` in the table)."""
        self.step += 1
        parts = self.fleet.parts(self.spec["job_id"], self.spec["attempt_number"])
        shards = await self.fleet.upload_shards(parts, self.step)
        await asyncio.gather(*(agent.report_shards(run, shards[agent.name]) for agent, run in parts))

    async def storage(self) -> None:
        rank = self.spec["node_rank"] * self.spec["nproc_per_node"]
        key = shard_key(job_checkpoint_prefix(self.spec["job_id"]), OPEN_STEP, self.spec["attempt_number"], rank)
        r = await self.agent.http.post(f"{AGENT}/attempts/{self.run.attempt_id}/storage", headers=self.agent._headers(),
                                       json=self._body(rank=rank, method="PUT", key=key, size_bytes=256))
        self._ok(r, "storage grant")

    async def slot(self) -> None:
        rank = self.spec["node_rank"] * self.spec["nproc_per_node"]
        path = f"{AGENT}/attempts/{self.run.attempt_id}/upload-slots"
        answer = self._ok(await self.agent.http.post(
            path, headers=self.agent._headers(), json=self._body(rank=rank, step=OPEN_STEP, size_bytes=256, wait_s=0)),
            "upload slot")
        if answer["state"] != "granted":
            raise RuntimeError(f"upload slot not granted at once: {answer}")
        self._ok(await self.agent.http.post(
            f"{path}/release", headers=self.agent._headers(),
            json=self._body(rank=rank, step=OPEN_STEP, ok=True, uploaded_bytes=256, upload_s=0.01)), "slot release")


async def measure(pid: int, count: int, send: Callable[[], Awaitable[None]], mark: Callable[[str], None],
                  name: str, per: int = 1) -> tuple[float, float]:
    """(CPU ms per request, wall ms per request) over ``count`` requests after 10 unmeasured ones
    (warm caches, prepared statements); the measured ones between two markers in PostgreSQL's log."""
    for _ in range(10):
        await send()
    mark(f"{name}-start")
    c0, t0 = cpu_s(pid), time.perf_counter()
    for _ in range(count):
        await send()
    c1, t1 = cpu_s(pid), time.perf_counter()
    mark(f"{name}-end")
    n = count * per
    return (c1 - c0) * 1000 / n, (t1 - t0) * 1000 / n


def statements_between(log: str, name: str) -> int:
    """SQL statements PostgreSQL logged between the two markers of ``name`` (log_statement = all:
    each simple query and each execution of a prepared one is one line)."""
    start = log.index(f"trainyard-mark-{name}-start")
    end = log.index(f"trainyard-mark-{name}-end", start)
    lines = log[start:end].splitlines()[1:]
    return sum(1 for line in lines if "LOG:  statement:" in line or "LOG:  execute" in line)


async def run(args: argparse.Namespace, cp: ControlPlane, s3: S3Target, pg_url: str,
              pg_log: Path) -> list[tuple[str, ...]]:
    import psycopg

    assert cp.proc is not None
    pid = cp.proc.pid
    fleet = Fleet(cp, s3, gpus_per_node=8, interval_s=1.0, follow_interval=True, long_poll=True)
    db = psycopg.connect(pg_url.replace("postgresql+psycopg:", "postgresql:", 1), autocommit=True)

    def mark(what: str) -> None:
        db.execute(f"SELECT 'trainyard-mark-{what}'")

    rows: list[tuple[str, ...]] = []
    try:
        await fleet.grow(args.nodes)
        job = await fleet.submit("request-cost", args.nodes)
        parts = await fleet.wait_parts(job["id"], 1, args.nodes)
        # Every node's loops stop: only the measured requests reach the control plane (its own
        # monitor and scheduler loops still run: measured apart, as "idle", and subtracted).
        await asyncio.sleep(2.0)
        for task in fleet._loops:
            task.cancel()
        await asyncio.gather(*fleet._loops, return_exceptions=True)
        fleet._loops.clear()
        await asyncio.sleep(1.0)
        agent, run_ = sorted(parts, key=lambda p: p[1].spec["node_rank"])[0]
        kinds = Kinds(fleet, agent, run_)
        db.execute("ALTER SYSTEM SET log_statement = 'all'")
        db.execute("SELECT pg_reload_conf()")
        await asyncio.sleep(1.0)
        mark("idle-start")
        c0, t0 = cpu_s(pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle_s = time.perf_counter() - t0
        idle_cpu_per_s = (cpu_s(pid) - c0) / idle_s
        mark("idle-end")
        say(f"idle control plane: {idle_cpu_per_s * 1000:.1f} ms of CPU per second (its own loops)")
        base = None
        measured = []
        for name in KINDS:
            per = args.nodes if name == "checkpoint" else 1
            count = max(10, args.requests // per)
            cpu_ms, wall_ms = await measure(pid, count, getattr(kinds, name), mark, name, per)
            cpu_ms = max(0.0, cpu_ms - idle_cpu_per_s * wall_ms)
            base = base if base is not None else cpu_ms
            measured.append((name, cpu_ms, wall_ms, count * per))
            say(f"{name}: {cpu_ms:.2f} ms CPU, {wall_ms:.2f} ms wall per request")
        await asyncio.sleep(1.0)
        log = pg_log.read_text(errors="replace")
        if args.keep_log:
            args.keep_log.write_text(log)
        idle_per_s = statements_between(log, "idle") / idle_s
        for name, cpu_ms, wall_ms, n in measured:
            sql = max(0.0, statements_between(log, name) / n - idle_per_s * wall_ms / 1000)
            ratio = f"{cpu_ms / base:.1f}" if base else "-"
            rows.append((name, f"{cpu_ms:.2f}", ratio, f"{wall_ms:.2f}", f"{sql:.1f}"))
        db.execute("ALTER SYSTEM RESET log_statement")
        db.execute("SELECT pg_reload_conf()")
        await fleet.cancel(job["id"])
    finally:
        db.close()
        await fleet.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4, help="simulated nodes (8 GPU slots each), all in the job")
    parser.add_argument("--requests", type=int, default=200, help="requests of each kind")
    parser.add_argument("--keep-log", type=Path, default=None,
                        help="write PostgreSQL's log (every statement, between markers per kind) to this file")
    parser.add_argument("--idle-s", type=float, default=3.0, help="seconds to measure the idle control plane")
    args = parser.parse_args()

    from control_plane.db import run_migrations
    from trainyard.embedded import EmbeddedPostgres, EmbeddedS3

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="trainyard-request-cost-") as tmp:
        data = Path(tmp)
        say(f"starting PostgreSQL and S3 in {data}")
        pg = EmbeddedPostgres(data / "postgres", database="trainyard")
        s3_server = EmbeddedS3(data / "s3", access_key="cost", secret_key=secrets.token_urlsafe(16),
                               bucket="trainyard", log_path=data / "s3.log")
        cp: ControlPlane | None = None
        try:
            run_migrations(pg.url)
            s3 = S3Target(s3_server.endpoint, "cost", s3_server.secret_key, "trainyard")
            cp = ControlPlane(pg.url, s3, admin_token=secrets.token_urlsafe(12), join_token=secrets.token_urlsafe(12),
                              log_path=data / "control-plane.log",
                              env={  # nodes whose heartbeats are paused stay in the job for the whole run
                                  "TRAINYARD_NODE_LOST_TIMEOUT_S": "120", "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "900",
                                  "TRAINYARD_CHECKPOINT_PENDING_TIMEOUT_S": "1200"})
            try:
                cp.start()
            except RuntimeError:
                print(cp.log_path.read_text()[-3000:], file=sys.stderr)
                raise
            rows = asyncio.run(run(args, cp, s3, pg.url, pg.data_dir / "log"))
        finally:
            if cp is not None:
                cp.stop()
            s3_server.stop()
            pg.stop()
    print()
    print(f"Control-plane cost per request ({args.requests} of each, one after the other, one replica, HTTP)")
    print(f"{'request':<10} {'CPU ms':>8} {'x healthz':>10} {'wall ms':>8} {'SQL':>6}")
    for row in rows:
        print(f"{row[0]:<10} {row[1]:>8} {row[2]:>10} {row[3]:>8} {row[4]:>6}")
    print()
    print("CPU ms: the control plane's user+system CPU per request, its idle loops subtracted; x healthz: the")
    print("same over the baseline request (the HTTP stack alone), same run; wall ms: as the agent saw it;")
    print("SQL: statements PostgreSQL ran per request (its log, log_statement = all, during the measurement;")
    print("BEGIN and COMMIT included; the idle loops' rate subtracted).""")
    print("slot: an ask (granted at once: no limit is set) and its release, two requests. checkpoint: per")
    print("node's shard report of a step every node reports at once (8 shards each), its commit included.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
