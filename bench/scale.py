"""Scale benchmark: many simulated node agents against one real control plane (finding 21).

    .venv/bin/python bench/scale.py [--agents 160] [--ranks 512,1024] [--window 5]
    .venv/bin/python bench/scale.py --agents 250,1000,2000 --ranks 512,1024     # the full run
    .venv/bin/python bench/scale.py --agents 250 --ranks 512,1024 --repeat 3    # job figures, medians

Starts embedded PostgreSQL and S3 (SeaweedFS) in a temporary directory, a ``trainyard server``
subprocess on them, and ``--agents`` simulated agents (trainyard/dev/fleet.py) in this process, each
speaking the real agent protocol over HTTP with 8 GPU slots each: heartbeats at the interval the
control plane tells them (it grows with the fleet: heartbeat_target_rate_per_s, ``--target-rate``) and a
long poll open (``--protocol fixed``: a heartbeat every ``--interval`` seconds, the protocol before). Then:

1. heartbeat latency p50/p99 of every agent while idle, at each ``--agents`` size (the fleet grows);
2. at the first size, one job per ``--ranks`` (one after the other): assigned; steady heartbeats with
   the delta protocol, then with full specs (an old agent, no ``known``: the baseline, same run);
   one checkpoint of one small shard per rank uploaded to S3 and reported by every node at once;
   a rank failure (exit code 1) and the recovery attempt assigned to every node; cancelled.

A job that checkpoints while the fleet heartbeats, through the real per-rank protocol and the
per-node batch one, with the fleet in its own process: bench/checkpoint_scale.py (issue 27).

The simulated agents share the 2 cores with the control plane and PostgreSQL, so latencies include
the client's own scheduling delay: they are upper bounds. Targets (issue 9): per-node payloads
independent of world size; p99 heartbeat < 100 ms at 1,000 agents; 1,024-shard commit < 2 s; new
attempt assigned < 2 s after the failure report.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev.fleet import (  # noqa: E402
    ControlPlane,
    Fleet,
    JobFigures,
    S3Target,
    job_scenario,
    percentile,
)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


async def run(args: argparse.Namespace, cp: ControlPlane, s3: S3Target) -> None:
    scaled = args.protocol == "scaled"
    fleet = Fleet(cp, s3, gpus_per_node=8, interval_s=args.interval, follow_interval=scaled, long_poll=scaled)
    idle: list[tuple[int, float, float, int, float, float, float]] = []
    jobs: list[JobFigures] = []
    try:
        for i, n in enumerate(args.agents):
            say(f"growing the fleet to {n} agents")
            await fleet.grow(n)
            await asyncio.sleep(args.interval * 2)  # registration burst over, loops spread out
            await asyncio.sleep(fleet.longest_interval())  # every agent follows the interval it was told
            waits = fleet.waits
            samples = await fleet.measure(f"idle-{n}", args.window)
            lat = [s.latency_s for s in samples]
            idle.append((n, percentile(lat, 50), percentile(lat, 99), len(lat), len(lat) / args.window,
                         (fleet.waits - waits) / args.window, fleet.longest_interval()))
            say(f"{n} agents idle: p50 {idle[-1][1] * 1000:.1f} ms, p99 {idle[-1][2] * 1000:.1f} ms, "
                f"{idle[-1][4]:.0f} heartbeats/s at an interval of {idle[-1][6]:g}s")
            if i == 0:
                for ranks in args.ranks:
                    if ranks // 8 > n:
                        say(f"skipping the {ranks}-rank job: it needs {ranks // 8} agents")
                        continue
                    for _ in range(args.repeat):
                        jobs.append(await job_scenario(fleet, ranks, window_s=args.window, say=say))
    finally:
        await fleet.close()
    if fleet.errors:
        say(f"{len(fleet.errors)} protocol errors, e.g. {fleet.errors[:3]}")
    if fleet.server_errors:
        say(f"{len(fleet.server_errors)} server errors (5xx or broken connections, retried), "
            f"e.g. {fleet.server_errors[:3]}; see {cp.log_path}")

    print()
    mode = ("interval told by the control plane, long poll" if scaled
            else f"fixed {args.interval:g} s interval, no long poll")
    print(f"Heartbeat latency, idle fleet (protocol: {mode})")
    print(f"{'agents':>8} {'p50 ms':>8} {'p99 ms':>8} {'samples':>8} {'hb/s':>7} {'waits/s':>8} {'interval s':>11}"
          "   target: p99 < 100 ms at 1,000")
    for n, p50, p99, count, rate, waits_rate, interval in idle:
        print(f"{n:>8} {p50 * 1000:>8.1f} {p99 * 1000:>8.1f} {count:>8} {rate:>7.1f} {waits_rate:>8.1f} "
              f"{interval:>11g}")
    print()
    print(f"Jobs (fleet of {args.agents[0]} agents, 8 ranks per node)")
    header = (f"{'ranks':>6} {'first B':>11} {'hb steady B':>12} {'full-spec B':>12} {'recovered B':>12} "
              f"{'steady p50/p99 ms':>18} {'full-spec p50/p99 ms':>21} {'commit s':>9} {'fail->1st s':>12} "
              f"{'fail->all s':>12}")
    print(header)
    for j in jobs:
        d50, d99, _ = j.extra[f"steady-{j.ranks}"]
        l50, l99, _ = j.extra[f"legacy-{j.ranks}"]
        print(f"{j.ranks:>6} {j.first_bytes:>11} {j.steady_bytes:>12} {j.legacy_steady_bytes:>12} "
              f"{j.recovered_first_bytes:>12} {f'{d50 * 1000:.1f}/{d99 * 1000:.1f}':>18} "
              f"{f'{l50 * 1000:.1f}/{l99 * 1000:.1f}':>21} {j.commit_s:>9.2f} {j.recovery_first_s:>12.2f} "
              f"{j.recovery_all_s:>12.2f}")
    if args.repeat > 1:
        print(f"medians of {args.repeat} runs")
        for ranks in args.ranks:
            runs = [j for j in jobs if j.ranks == ranks]
            if runs:
                print(f"{ranks:>6} commit s {statistics.median(j.commit_s for j in runs):.2f}, fail->1st s "
                      f"{statistics.median(j.recovery_first_s for j in runs):.2f}, fail->all s "
                      f"{statistics.median(j.recovery_all_s for j in runs):.2f}")
    for j in jobs:
        c50, c99, count = j.extra["checkpoint_hb"]
        print(f"{j.ranks:>6} ranks: heartbeats of every agent during the checkpoint: p50 {c50 * 1000:.1f} ms, "
              f"p99 {c99 * 1000:.1f} ms ({count} samples)")
    print()
    print("first B: largest answer to a node of the job carrying its new spec (its long poll's); hb steady B:")
    print("largest response of such a node once it holds the spec (delta protocol, sent every second);")
    print("full-spec B: the same node as an old agent (no `known`: the full spec, credentials included,")
    print("every second: the protocol before finding 21); recovered B: the answer carrying the recovery")
    print("attempt's spec (it includes the restore plan). commit s: from the first shard report of a step")
    print("to the acknowledgement that committed it (every node reports its 8 shards at once). fail->1st")
    print("/all s: from the failure report until the first / every node holds the recovery attempt.")
    print("Targets: steady bytes independent of ranks; commit < 2 s at 1,024 shards; fail->all < 2 s.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=_ints, default=[160], help="fleet sizes, comma-separated, growing")
    parser.add_argument("--ranks", type=_ints, default=[512, 1024], help="job sizes in ranks (8 per node)")
    parser.add_argument("--window", type=float, default=5.0, help="seconds of each latency window")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each job that many times on the first fleet size (the table adds medians)")
    parser.add_argument("--interval", type=float, default=1.0,
                        help="heartbeat interval of the agents (the control plane's minimum with --protocol scaled)")
    parser.add_argument("--protocol", choices=["scaled", "fixed"], default="scaled",
                        help="scaled: agents follow the interval the control plane tells them and keep a long "
                        "poll open; fixed: every --interval seconds, no long poll (the protocol before)")
    parser.add_argument("--target-rate", type=float, default=None,
                        help="the control plane's heartbeat_target_rate_per_s (default: its default)")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the databases here")
    args = parser.parse_args()
    if args.agents != sorted(args.agents):
        parser.error("--agents must grow")

    from control_plane.db import run_migrations
    from trainyard.embedded import EmbeddedPostgres, EmbeddedS3

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so that the servers below are stopped on SIGTERM too

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="trainyard-scale-") as tmp:
        data = args.data_dir or Path(tmp)
        say(f"starting PostgreSQL and S3 in {data}")
        pg = EmbeddedPostgres(data / "postgres", database="trainyard")
        s3_server = EmbeddedS3(data / "s3", access_key="scale", secret_key=secrets.token_urlsafe(16),
                               bucket="trainyard", log_path=data / "s3.log")
        cp: ControlPlane | None = None
        try:
            run_migrations(pg.url)
            s3 = S3Target(s3_server.endpoint, "scale", s3_server.secret_key, "trainyard")
            cp = ControlPlane(pg.url, s3, admin_token=secrets.token_urlsafe(12), join_token=secrets.token_urlsafe(12),
                              log_path=data / "control-plane.log",
                              env={"TRAINYARD_NODE_LOST_TIMEOUT_S": "30", "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "120",
                                   "TRAINYARD_HEARTBEAT_INTERVAL_S": str(args.interval),
                                   **({"TRAINYARD_HEARTBEAT_TARGET_RATE_PER_S": str(args.target_rate)}
                                      if args.target_rate else {})})
            say(f"starting the control plane (log: {cp.log_path})")
            cp.start()
            asyncio.run(run(args, cp, s3))
        finally:
            if cp is not None:
                cp.stop()
            s3_server.stop()
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
