"""Resource limits per part (issue 23, finding 6): a normal job's start, from the agent's launch to
the first training step, with and without limits, in one run.

Each round launches a one-rank part the way the agent does (node_agent/part/parts.py: a pool uid, the
part's cgroup, ``Part.launch``: torchrun, the rank shim, the script) twice, once by an agent
configured with the default limits (memory, pids and cpu cgroups, a /dev/shm tmpfs, the agent
watching the work directory) and once with ``--no-part-limits``; the order alternates. Timed: from
``Isolation.confine`` (where the limits are set) to the script's first step done (a tiny model's
forward, backward and optimizer step, after ``import torch``), as the script records it. Medians
of ``--repeat`` rounds; ``ratio`` is limits / none, of the medians and (less sensitive to a shared
machine's drifting load) the median of each round's own ratio. Needs root (no limits otherwise: it says so).

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/start_limits.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from node_agent.confinement.isolation import Isolation, UidRange, worker_tmp  # noqa: E402
from node_agent.confinement.limits import LimitOptions  # noqa: E402
from node_agent.part.attempt import Part  # noqa: E402
from node_agent.part.commands import AttemptPaths, NodeContext  # noqa: E402
from tests.helpers import rendezvous_port  # noqa: E402
from trainyard.protocol.agent import LaunchSpec  # noqa: E402

UIDS = UidRange(20180, 20183)  # a corner of the dev pool (trainyard.dev.DEV_WORKER_UIDS) no test uses
SCRIPT = """\
import os, time
import torch
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(8, 64)).sum().backward()
optimizer.step()
with open(os.path.join(os.environ["TMPDIR"], "first-step"), "w") as f:
    f.write(repr(time.time()))
"""


def _spec(number: int) -> LaunchSpec:
    attempt_id = f"bench-{os.getpid()}-{number}"
    return LaunchSpec(job_id="bench", job_name="bench", attempt_id=attempt_id, attempt_number=1,
                      fencing_token=f"fence-{attempt_id}", node_rank=0, nnodes=1, nproc_per_node=1, gpu_indices=[0],
                      rdzv_host="127.0.0.2", rdzv_port=rendezvous_port("127.0.0.2"), entrypoint="train.py",
                      checkpoint={"every_steps": 10})


def _start(isolation: Isolation, work: Path, code: Path, number: int) -> tuple[float, float]:
    """Seconds from the part's confinement to its first step, and of the confinement alone."""
    spec = _spec(number)
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, join_timeout_s=60,
                       shutdown_timeout_s=2, monitor_interval_s=0.2, cwd=str(code))
    paths = AttemptPaths(work / "attempts" / spec.attempt_id, work / "workers" / spec.attempt_id)
    started = time.time()
    confinement = isolation.confine("bench", spec.attempt_id, 0, lambda: set(), gpus=1)
    confined = time.time() - started
    run = Part.launch(spec, node, paths, stop_grace_s=2.0, confinement=confinement)
    marker = worker_tmp(paths.worker) / "first-step"  # the part's TMPDIR (a short one of its own since issue 24)
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            run.poll()  # as the agent's supervision does (with limits: their checks too)
            if run.finished or time.monotonic() > deadline:
                raise SystemExit(f"the part ended or hung before its first step: {run.report(None, None).error}")
            time.sleep(0.02)
        first = float(marker.read_text() or "nan")
        while not run.finished:
            run.poll()
            time.sleep(0.05)
    finally:
        run.kill_now()
        while not run.finished:
            run.poll()
            time.sleep(0.05)
        isolation.release(confinement)
    return first - started, confined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: an agent that is not root sets no limits, so there is nothing to compare")
    work = Path(tempfile.mkdtemp(prefix="trainyard-bench-limits-"))
    work.chmod(0o711)
    try:
        code = work / "code"
        code.mkdir(mode=0o755)
        (code / "train.py").write_text(SCRIPT)
        (work / "workers").mkdir(mode=0o711)
        setups = {}
        for name, options in (("limits", LimitOptions()), ("none", LimitOptions(enabled=False))):
            isolation, notes = Isolation.configure(UIDS, work / f"run-{name}", use_cgroups=True, cwd=str(code),
                                                   limits=options, gpus=1, work_dir=work)
            setups[name] = isolation
            print(f"# {name}: " + "; ".join(notes))
        times: dict[str, list[float]] = {"limits": [], "none": []}
        setup: dict[str, list[float]] = {"limits": [], "none": []}
        _start(setups["none"], work, code, 0)  # warm the page cache (torch's files) for both
        for number in range(args.repeat):
            order = ("limits", "none") if number % 2 == 0 else ("none", "limits")
            for name in order:
                total, confined = _start(setups[name], work, code, 1 + 2 * number + order.index(name))
                times[name].append(total)
                setup[name].append(confined)
        medians = {name: statistics.median(values) for name, values in times.items()}
        setup_ms = {name: statistics.median(values) * 1000 for name, values in setup.items()}
        print(f"{'setup':8} {'median s':>9} {'min s':>7} {'max s':>7} {'confine ms':>11}  runs")
        for name, values in times.items():
            print(f"{name:8} {medians[name]:9.2f} {min(values):7.2f} {max(values):7.2f} {setup_ms[name]:11.1f}  "
                  f"{len(values)}")
        ratio = medians["limits"] / medians["none"]
        # Each round's two launches ran back to back: their ratio is less at the mercy of the load
        # of a shared machine, which drifts over minutes, than the ratio of the medians.
        paired = statistics.median(a / b for a, b in zip(times["limits"], times["none"], strict=True))
        print(f"ratio limits/none: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); median of each round's ratio: "
              f"{paired:.3f} ({(paired - 1) * 100:+.1f}%)")
        print(json.dumps({"repeat": args.repeat, "median_s": medians, "confine_ms": setup_ms, "ratio": ratio,
                          "paired_ratio": paired}))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
