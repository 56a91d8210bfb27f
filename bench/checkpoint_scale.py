"""A job that checkpoints while the fleet heartbeats (issue 27): the control plane's cost of a
checkpoint, per rank (today's protocol, the baseline) and per node (the batch protocol), and what it
does to the heartbeats.

    .venv/bin/python bench/checkpoint_scale.py                                  # 128 nodes x 8 ranks
    .venv/bin/python bench/checkpoint_scale.py --replicas 2                     # and again on 2 replicas
    .venv/bin/python bench/checkpoint_scale.py --nodes 16 --checkpoints 1 --every 5   # a quick look

Starts embedded PostgreSQL and S3 in a temporary directory, ``--replicas`` ``trainyard server``
processes on them over HTTPS (a certificate from a local CA, trainyard/dev/certs.py) with the
production defaults for liveness (node-lost timeout, heartbeat interval scaled with the fleet), and
the simulated fleet (trainyard/dev/fleet.py) in a process of its own (trainyard/dev/fleet_proc.py):
``--nodes`` agents of ``--gpus`` GPUs that register, heartbeat at the interval the control plane
tells them with the real agent's per-try timeout and retries, and keep a long poll open. Then one
job on every GPU, and for each replica count (1, then 2 with ``--replicas 2``: agent i talks to
replica i % 2):

1. an idle window (the job runs, nothing is saved);
2. for each ``--modes`` (rank, node): ``--checkpoints`` checkpoints, one every ``--every`` seconds,
   of a 256-byte shard per rank through that protocol (trainyard/dev/fleet_saves.py), each measured
   from its start to its commit; the CPU of the control plane(s), PostgreSQL and the fleet read
   from /proc before and after each (psutil);
3. one rank exits with code 1, and the time until every node holds the recovery attempt.

Requests are counted by the fleet (every request it sends; the control plane counts none per
route). The fleet shares the machine's cores with the servers: latencies include its own
scheduling delay. The ``node`` mode needs the per-node batch endpoints (issue 27); a control plane
without them answers 404 and the table says so.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev.fleet import ControlPlane, Endpoints, S3Target, percentile  # noqa: E402
from trainyard.dev.fleet_proc import FleetProcess  # noqa: E402

CHECKPOINT_KINDS = ("slot", "grant", "release", "shards", "slot-batch", "grant-batch")
TIMEOUT_S = 2.8
"""The agent's per-try heartbeat timeout at the default settings (agent_request_timeout_s)."""


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def cpu_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU of ``pid`` (with ``children``: of its children too, ended ones included:
    PostgreSQL's backends)."""
    import psutil

    proc = psutil.Process(pid)
    t = proc.cpu_times()
    total = t.user + t.system
    if children:
        total += t.children_user + t.children_system
        for child in proc.children(recursive=True):
            try:
                c = child.cpu_times()
                total += c.user + c.system
            except psutil.Error:
                pass  # ended meanwhile: counted in children_* from now on
    return total


@dataclass
class Meter:
    """CPU of each measured process, read together."""

    servers: list[int]
    postgres: int
    fleet: int

    def read(self) -> tuple[float, float, float]:
        return (sum(cpu_seconds(p) for p in self.servers), cpu_seconds(self.postgres, children=True),
                cpu_seconds(self.fleet))


@dataclass
class Saves:
    replicas: int
    mode: str
    figures: list[dict[str, Any]] = field(default_factory=list)
    cpu: list[tuple[float, float, float]] = field(default_factory=list)
    unavailable: str | None = None


@dataclass
class Round:
    replicas: int
    idle_cpu_per_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    idle_requests_per_s: float = 0.0
    saves: list[Saves] = field(default_factory=list)
    recovery_all_s: float = float("nan")
    recovery_split: str = ""


def _recovery_split(api: Endpoints, job_id: str, number: int) -> str:
    """Attempt ``number``'s recovery phases as the control plane recorded them (GET .../attempts)."""
    import httpx

    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {api.admin_token}"},
                      verify=api.ca_file or True, timeout=30) as http:
        items = http.get(f"/v1/jobs/{job_id}/attempts", params={"limit": 10}).raise_for_status().json()["items"]
    rec = next((a.get("recovery") for a in items if a["number"] == number), None) or {}
    return ", ".join(f"{p} {rec[f'{p}_s']:.2f}s" for p in ("detection", "decision", "wake_up")
                     if rec.get(f"{p}_s") is not None) or "not recorded"


def _arrivals(answer: dict[str, Any], nodes: int) -> str:
    """When the nodes got the new attempt (seconds after the failure report), how many learned it
    from a heartbeat's answer rather than their long poll's, and what the fleet retried meanwhile."""
    retried = ", ".join(f"{n} x {what}" for what, n in (answer.get("retried") or {}).items()) or "none"
    return (f"nodes holding it: first {answer['first_s']:.2f}s, p50 {answer['p50_s']:.2f}s, "
            f"p90 {answer['p90_s']:.2f}s, {answer['by_heartbeat']} of {nodes} by a heartbeat; retried: {retried}")


def run(args: argparse.Namespace, fleet: FleetProcess, meter: Meter, api: Endpoints,
        restart: Callable[[bool], None] | None = None) -> tuple[list[Round], list[tuple[str, float, str]]]:
    say(f"registering {args.nodes} agents")
    fleet.call("grow", n=args.nodes)
    interval = float(fleet.call("interval")["interval_s"])
    time.sleep(2 * interval)  # the registration burst is over, the loops spread out
    job_id = fleet.call("job", name="ckpt-scale", nodes=args.nodes)["job_id"]
    say(f"job {job_id}: attempt 1 held by {args.nodes} nodes; heartbeat interval {interval:g}s")
    attempt, step = 1, 0
    rounds = []
    for replicas in ([1, 2] if args.replicas == 2 else [1]):
        fleet.call("route", replicas=replicas)
        time.sleep(1.5 * interval)
        r = Round(replicas)
        fleet.call("phase", name=f"idle-{replicas}")
        before, t0, sent = meter.read(), time.monotonic(), fleet.call("requests")["requests"]
        time.sleep(args.idle)
        after, elapsed = meter.read(), time.monotonic() - t0
        r.idle_requests_per_s = (sum(fleet.call("requests")["requests"].values()) - sum(sent.values())) / elapsed
        r.idle_cpu_per_s = tuple((b - a) / elapsed for a, b in zip(before, after, strict=True))  # type: ignore[assignment]
        for mode in args.modes:
            saves = Saves(replicas, mode)
            r.saves.append(saves)
            for n in range(args.checkpoints):
                step += 100
                started = time.monotonic()
                before = meter.read()
                try:
                    answer = fleet.call("checkpoint", job_id=job_id, attempt=attempt, step=step, mode=mode,
                                        phase=f"ckpt-{mode}-{replicas}")
                except RuntimeError as exc:  # e.g. nodes declared lost: the attempt is gone, and the run
                    saves.unavailable = f"failed after {time.monotonic() - started:.0f}s: {exc}"
                    saves.cpu.append(tuple(b - a for a, b in zip(before, meter.read(), strict=True)))  # type: ignore[arg-type]
                    say(saves.unavailable)
                    rounds.append(r)
                    return rounds, []
                after = meter.read()
                if "unavailable" in answer:
                    saves.unavailable = answer["unavailable"]
                    say(f"{mode} protocol unavailable: {saves.unavailable}")
                    break
                saves.figures.append(answer)
                saves.cpu.append(tuple(b - a for a, b in zip(before, after, strict=True)))  # type: ignore[arg-type]
                say(f"{replicas} replica(s), {mode}: step {step} of {answer['ranks']} shards committed "
                    f"{answer['duration_s']:.2f}s after it began, {answer['commit_after_upload_s']:.2f}s after its "
                    f"last upload; control plane {saves.cpu[-1][0]:.1f} CPU-s")
                if n < args.checkpoints - 1 or mode != args.modes[-1]:
                    time.sleep(max(0.0, started + args.every - time.monotonic()))
        fleet.call("phase", name=f"fail-{replicas}")
        answer = fleet.call("fail", job_id=job_id, attempt=attempt, nodes=args.nodes)
        r.recovery_all_s = float(answer["all_s"])
        attempt += 1
        r.recovery_split = f"{_recovery_split(api, job_id, attempt)}; {_arrivals(answer, args.nodes)}"
        say(f"{replicas} replica(s): attempt {attempt} held by every node {r.recovery_all_s:.2f}s after the failure "
            f"(the control plane's split: {r.recovery_split})")
        fleet.call("phase", name="between")
        rounds.append(r)
    failures: list[tuple[str, float, str]] = []
    if restart is not None:  # --compare-passing: the same failure with lease passing off, then on again
        for passing in (False, True):
            restart(passing)
            time.sleep(2.5 * interval)  # every agent heartbeats and holds its long poll again
            fleet.call("phase", name=f"fail-passing-{'on' if passing else 'off'}")
            answer = fleet.call("fail", job_id=job_id, attempt=attempt, nodes=args.nodes)
            all_s = float(answer["all_s"])
            attempt += 1
            split = f"{_recovery_split(api, job_id, attempt)}; {_arrivals(answer, args.nodes)}"
            failures.append(("on" if passing else "off", all_s, split))
            say(f"lease passing {'on' if passing else 'off'}: attempt {attempt} held by every node {all_s:.2f}s after "
                f"the failure ({split})")
            fleet.call("phase", name="between")
    fleet.call("cancel", job_id=job_id)
    return rounds, failures


def _hb(samples: list[list[Any]], prefix: str) -> tuple[float, float, int, str]:
    """p50, p99, tries, and "late/timed out": tries answered after the per-try timeout (httpx bounds
    each phase of a try, connection, TLS handshake and read, not their sum, in the real agent too)
    / tries that raised it."""
    ours = [s for s in samples if str(s[0]).startswith(prefix)]
    lat = [s[1] for s in ours]
    late = sum(1 for s in ours if s[1] >= TIMEOUT_S and not s[2])
    return percentile(lat, 50), percentile(lat, 99), len(lat), f"{late}/{sum(1 for s in ours if s[2])}"


def _lag(lags: list[list[Any]], prefix: str) -> float:
    return max([lag for phase, lag in lags if str(phase).startswith(prefix)] or [0.0])


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def report(args: argparse.Namespace, rounds: list[Round], seen: dict[str, Any],
           failures: list[tuple[str, float, str]] | None = None) -> None:
    hb = seen["heartbeats"]
    print()
    print(f"Checkpoints of a {args.nodes * args.gpus}-rank job on {args.nodes} nodes x {args.gpus} GPUs, "
          f"one every {args.every:g}s, 256-byte shards; per checkpoint (median of {args.checkpoints}):")
    head = (f"{'replicas':>8} {'protocol':>8} {'ckpt req':>9} {'all req':>8} {'cp CPU-s':>9} {'own':>6} "
            f"{'pg CPU-s':>9} {'fleet CPU-s':>11} {'begin->commit s':>16} {'upload->commit s':>17} "
            f"{'hb p50/p99 ms':>15} "
            f"{'hb late/timed out':>17} {'fleet lag s':>11}")
    print(head)
    table: dict[tuple[int, str], dict[str, float]] = {}
    for r in rounds:
        for s in r.saves:
            if s.unavailable or not s.figures:
                print(f"{r.replicas:>8} {s.mode:>8}   not measured: {(s.unavailable or 'no checkpoint')[:300]}")
                if s.cpu:  # it failed: what its heartbeats went through until then
                    p50, p99, count, late = _hb(hb, f"ckpt-{s.mode}-{r.replicas}")
                    print(f"{'':>18}until it failed: control plane {s.cpu[-1][0]:.1f} CPU-s, PostgreSQL "
                          f"{s.cpu[-1][1]:.1f}, fleet {s.cpu[-1][2]:.1f}; {count} heartbeat tries, p50 "
                          f"{p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, late/timed out {late}")
                continue
            med = statistics.median
            # The control plane's CPU for the checkpoint's own requests: its CPU meanwhile less what the
            # other requests (heartbeats, long polls) cost at the idle window's CPU per request.
            per_request = r.idle_cpu_per_s[0] / r.idle_requests_per_s if r.idle_requests_per_s else 0.0
            own = [c[0] - per_request * sum(n for k, n in f["requests"].items() if k not in CHECKPOINT_KINDS)
                   for c, f in zip(s.cpu, s.figures, strict=True)]
            row = {
                "own": med(own),
                "ckpt": med(sum(f["requests"].get(k, 0) for k in CHECKPOINT_KINDS) for f in s.figures),
                "all": med(sum(f["requests"].values()) for f in s.figures),
                "cp": med(c[0] for c in s.cpu), "pg": med(c[1] for c in s.cpu), "fleet": med(c[2] for c in s.cpu),
                "dur": med(f["duration_s"] for f in s.figures),
                "commit": med(f["commit_after_upload_s"] for f in s.figures),
                "commit_max": max(f["commit_after_upload_s"] for f in s.figures),
            }
            p50, p99, _, timeouts = _hb(hb, f"ckpt-{s.mode}-{r.replicas}")
            row.update(p50=p50, p99=p99, timeouts=timeouts)
            table[(r.replicas, s.mode)] = row
            print(f"{r.replicas:>8} {s.mode:>8} {row['ckpt']:>9.0f} {row['all']:>8.0f} {row['cp']:>9.2f} "
                  f"{row['own']:>6.2f} {row['pg']:>9.2f} {row['fleet']:>11.2f} {row['dur']:>16.2f} "
                  f"{row['commit']:>17.2f} "
                  f"{f'{p50 * 1000:.0f}/{p99 * 1000:.0f}':>15} {timeouts:>17} "
                  f"{_lag(seen['loop_lags'], f'ckpt-{s.mode}-{r.replicas}'):>11.2f}")
    print()
    print(f"{'replicas':>8} {'idle hb p50/p99 ms':>19} {'late/timed out':>16} {'idle cp CPU/s':>14} "
          f"{'idle pg CPU/s':>14} {'fail->every node s':>19}")
    for r in rounds:
        p50, p99, _, timeouts = _hb(hb, f"idle-{r.replicas}")
        print(f"{r.replicas:>8} {f'{p50 * 1000:.0f}/{p99 * 1000:.0f}':>19} {timeouts:>16} "
              f"{r.idle_cpu_per_s[0]:>14.2f} {r.idle_cpu_per_s[1]:>14.2f} {r.recovery_all_s:>19.2f}")
    print()
    for replicas in sorted({r.replicas for r in rounds}):
        rank, node = table.get((replicas, "rank")), table.get((replicas, "node"))
        if rank and node:
            print(f"{replicas} replica(s), per node / per rank: requests {_ratio(node['ckpt'], rank['ckpt'])}, "
                  f"control-plane CPU {_ratio(node['cp'], rank['cp'])} (its own {_ratio(node['own'], rank['own'])}), "
                  f"PostgreSQL CPU "
                  f"{_ratio(node['pg'], rank['pg'])}, begin->commit {_ratio(node['dur'], rank['dur'])}, "
                  f"heartbeat p99 {_ratio(node['p99'], rank['p99'])}")
    for mode in args.modes:
        one, two = table.get((1, mode)), table.get((2, mode))
        if one and two:
            print(f"{mode} protocol, 2 replicas / 1: begin->commit {_ratio(two['dur'], one['dur'])}, heartbeat p99 "
                  f"during checkpoints {_ratio(two['p99'], one['p99'])}, control-plane CPU "
                  f"{_ratio(two['cp'], one['cp'])} (both replicas)")
    one_round = rounds[0]
    best = table.get((1, "node")) or table.get((1, "rank"))
    if best:
        mode = "node" if (1, "node") in table else "rank"
        total_timeouts = seen["heartbeat_timeouts"]
        print()
        late_all = sum(1 for s in hb if s[1] >= TIMEOUT_S)
        print(f"Targets at 1 replica ({mode} protocol): heartbeat p99 during checkpoints < 250 ms: "
              f"{best['p99'] * 1000:.0f} ms; commit < 2 s after the last upload: {best['commit_max']:.2f} s (worst); "
              f"0 heartbeat timeouts: late/timed out {best['timeouts']} during its checkpoints, {late_all}/"
              f"{total_timeouts} in the whole run ({len(hb)} tries); failure -> new attempt on every node < 2 s: "
              f"{one_round.recovery_all_s:.2f} s")
    print()
    print("ckpt req: the checkpoint's own requests (slots, grants, releases, shard reports, batches); all req:")
    print("every request the fleet sent meanwhile (heartbeats and long polls included). CPU-s: CPU seconds of")
    print("the control plane(s), PostgreSQL (every backend) and the fleet from a checkpoint's start to its commit")
    print("(heartbeats included); own: the control plane's less the other requests at the idle window's CPU per")
    print("request (an estimate of the checkpoint's own cost).")
    print(f"hb late/timed out: heartbeat tries answered after the agent's {TIMEOUT_S:g} s")
    print("per-try timeout / tries that ran out of it (httpx bounds each phase of a try, as in the agent).")
    print("fleet lag: the longest the fleet's event loop was late (its own delay is in the latencies).")
    print("fail->every node: from the failure report until every node holds the recovery attempt.")
    if failures:
        print()
        print(f"The same failure after a control-plane restart, lease passing off (the baseline) and on "
              f"({args.replicas} replica(s)):")
        print(f"{'lease passing':>13} {'fail->every node s':>19}  the control plane's split")
        for passing, all_s, split in failures:
            print(f"{passing:>13} {all_s:>19.2f}  {split}")
        off = [a for p, a, _ in failures if p == "off"]
        on = [a for p, a, _ in failures if p == "on"]
        if off and on:
            print(f"on / off: {_ratio(on[0], off[0])}")
    if seen["error_count"] or seen["server_error_count"]:
        print(f"fleet: {seen['error_count']} protocol errors (e.g. {seen['errors'][:2]}), "
              f"{seen['server_error_count']} server errors or timeouts retried (e.g. {seen['server_errors'][:2]})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=128, help="simulated agents, one job on all of them")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs (ranks) per node")
    parser.add_argument("--checkpoints", type=int, default=3, help="checkpoints per protocol and replica count")
    parser.add_argument("--every", type=float, default=30.0, help="seconds from one checkpoint's start to the next")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds of the idle window before them")
    parser.add_argument("--modes", type=lambda t: [m for m in t.split(",") if m], default=["rank", "node"],
                        help="protocols, comma-separated: rank (today's, the baseline), node (the batch protocol)")
    parser.add_argument("--replicas", type=int, choices=[1, 2], default=1,
                        help="2: the same measurements again with the agents split over two replicas")
    parser.add_argument("--http", action="store_true", help="plain HTTP instead of HTTPS")
    parser.add_argument("--node-lost-timeout", type=float, default=None,
                        help="the control plane's node_lost_timeout_s (default: its default, 10 s at the shortest "
                        "interval; a node told a longer one gets as much more). Longer: the figures of a control "
                        "plane too slow to keep its nodes, instead of a failed attempt")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the databases and logs here")
    parser.add_argument("--compare-passing", action="store_true",
                        help="at the end, restart the control plane(s) with lease passing off "
                        "(TRAINYARD_RECOVERY_PASS_LEASES=false) and fail a rank again, then on and again: "
                        "failure -> every node with and without it, in one run")
    args = parser.parse_args()
    if set(args.modes) - {"rank", "node"}:
        parser.error("--modes takes rank and node")

    from control_plane.db import run_migrations
    from trainyard.embedded import EmbeddedPostgres, EmbeddedS3

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # so that the processes below are stopped on SIGTERM too

    signal.signal(signal.SIGTERM, interrupted)
    with tempfile.TemporaryDirectory(prefix="trainyard-ckpt-scale-") as tmp:
        data = args.data_dir or Path(tmp)
        say(f"starting PostgreSQL and S3 in {data}")
        pg = EmbeddedPostgres(data / "postgres", database="trainyard")
        s3_server = EmbeddedS3(data / "s3", access_key="scale", secret_key=secrets.token_urlsafe(16),
                               bucket="trainyard", log_path=data / "s3.log")
        cps: list[ControlPlane] = []
        fleet: FleetProcess | None = None
        try:
            run_migrations(pg.url)
            s3 = S3Target(s3_server.endpoint, "scale", s3_server.secret_key, "trainyard")
            admin, join = secrets.token_urlsafe(12), secrets.token_urlsafe(12)
            for i in range(args.replicas):
                env = ({"TRAINYARD_NODE_LOST_TIMEOUT_S": f"{args.node_lost_timeout:g}",
                        # it must outlast the longest node-lost timeout (settings.py checks it)
                        "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": f"{args.node_lost_timeout + 60:g}",
                        "TRAINYARD_CHECKPOINT_PENDING_TIMEOUT_S": f"{max(600.0, args.node_lost_timeout + 90):g}"}
                       if args.node_lost_timeout else {})
                cp = ControlPlane(pg.url, s3, admin_token=admin, join_token=join, env=env,
                                  log_path=data / f"control-plane-{i}.log", tls_dir=None if args.http else data / "tls")
                cps.append(cp)
                say(f"starting control plane {i} at {cp.url} (log: {cp.log_path})")
                cp.start()
            api = Endpoints([cp.url for cp in cps], admin, join, cps[0].ca_file)
            fleet = FleetProcess(api, log_path=data / "fleet.log", gpus_per_node=args.gpus)
            fleet.start()
            assert pg.pid is not None
            meter = Meter([cp.proc.pid for cp in cps if cp.proc is not None], pg.pid, fleet.pid)

            def restart(passing: bool) -> None:
                for cp in cps:
                    cp.stop()
                    cp.set_env(TRAINYARD_RECOVERY_PASS_LEASES="true" if passing else "false")
                    say(f"restarting control plane at {cp.url}, lease passing {'on' if passing else 'off'}")
                    cp.start()

            rounds, failures = run(args, fleet, meter, api, restart if args.compare_passing else None)
            seen = fleet.call("samples")
            report(args, rounds, seen, failures)
        finally:
            if fleet is not None:
                fleet.stop()
            for cp in cps:
                cp.stop()
            s3_server.stop()
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
