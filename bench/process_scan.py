"""The agent's process scan beside a fork bomb: how long one ``processes.scan()`` takes while another
part on the machine keeps forking at its pids limit, against the way the scan read processes before
(every process's environment, /proc/<pid>/environ), in one run.

A fork bomb (tests/e2e/hog_job.py forkbomb) runs in a part's cgroups with the part's pids limit, set
the agent's way (cgroups.LimitTree). Then, alternating for ``--seconds`` each round: the scan as the
agent runs it (a process in a part's cgroup is read from /proc/<pid>/cgroup), and the baseline, the
same psutil pass that reads every process's environment. Every agent on a node scans (a
registration before its first heartbeat, the supervise loop each poll); ``ratio`` is scan / baseline
of the medians and of the worst single pass. Needs root and a writable cgroup v2 (it says so).

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/process_scan.py [--pids 512] [--seconds 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.confinement import processes  # noqa: E402
from node_agent.confinement.cgroups import CgroupTree, LimitTree  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def environ_pass() -> None:
    """The baseline: what scan() did for every process before it read cgroups."""
    for proc in psutil.process_iter(["uids", "status", "create_time"]):
        try:
            os.getpgid(proc.pid)
            proc.environ()
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue


def timed(what: Callable[[], object], seconds: float) -> list[float]:
    times: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.monotonic()
        what()
        times.append(time.monotonic() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pids", type=int, default=512, help="the bomb's part pids limit (default 512)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per method and round (default 10)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    tracking, why = CgroupTree.detect()
    limits, why_limits = LimitTree.detect(tracking)
    if tracking is None or limits is None:
        print(f"cannot run: {why if tracking is None else why_limits}")
        return 2
    node_id, attempt_id = f"node-bench-{os.getpid()}", f"att-bomb{os.getpid()}"
    cgroup = tracking.for_part(node_id, attempt_id, 0)
    cgroup.create()
    groups = limits.for_part(cgroup, node_id, attempt_id, 0)
    groups.apply(memory=None, pids=args.pids, cpus=None, cpu_weight=100)
    joins = " && ".join(f"echo $$ > {path}/cgroup.procs" for path in {cgroup.path, *groups.joins()})
    bomb = subprocess.Popen(["/bin/sh", "-c", f"{joins} && exec {sys.executable} {ROOT}/tests/e2e/hog_job.py forkbomb"],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    results: dict[str, list[float]] = {"scan": [], "environ": []}
    try:
        deadline = time.monotonic() + 30
        while len(cgroup.pids()) < args.pids * 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
        members = len(cgroup.pids())
        for number in range(args.rounds):
            order = ["scan", "environ"] if number % 2 == 0 else ["environ", "scan"]
            for method in order:
                results[method] += timed(processes.scan if method == "scan" else environ_pass, args.seconds)
    finally:
        cgroup.signal(signal.SIGKILL)
        bomb.wait(10)
        end = time.monotonic() + 10
        while not cgroup.remove() and time.monotonic() < end:
            time.sleep(0.1)
        groups.remove()
    print(f"process scan beside a fork bomb of {members} processes (pids limit {args.pids}), "
          f"{args.rounds} rounds of {args.seconds:g} s per method")
    print(f"{'method':<10} {'passes':>7} {'median s':>9} {'worst s':>8}")
    for method, times in results.items():
        print(f"{method:<10} {len(times):>7} {statistics.median(times):>9.3f} {max(times):>8.3f}")
    scan, base = results["scan"], results["environ"]
    print(f"ratio scan/environ: median {statistics.median(scan) / statistics.median(base):.4f}, "
          f"worst {max(scan) / max(base):.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
