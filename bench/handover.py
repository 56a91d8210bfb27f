"""In-process restart under real agents: a restartable job's recovery with the healthy rank handed
over (``restartable: true``) against the same job restarted cold, in the same run.

    .venv/bin/python bench/handover.py [--steps 250] [--step-delay-s 0.04] [--repeat 1]

One dev cluster (embedded PostgreSQL and S3, 2 agents with 1 virtual GPU each) runs, per repeat, the
same 2-rank job (tests/e2e/restartable_job.py: a small DDP model in worker_runtime.run_restartable,
checkpointing every 10 steps) three times: once without a failure (the reference weights), then twice
with node rank 1's worker SIGKILLed once the first checkpoint committed: as a plain job (both ranks
start anew: the cold path every job takes today) and as a restartable one (node rank 0's worker is
parked, handed over and restarts in its process; docs/architecture.md, "In-process restart of
healthy ranks"). The phases come from the job view (``recovery`` of the second attempt). Every
killed run must end with the reference weights; the script checks it.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev import DevCluster, DevConfig  # noqa: E402
from trainyard.embedded import free_port  # noqa: E402

PHASES = ("detection", "decision", "wake_up", "process_start", "rendezvous", "restore")
ROWS = (("cold restart (restartable: false)", False), ("in-process restart (restartable: true)", True))


def wait_for(what: str, check: Any, timeout: float) -> Any:
    """``check()``'s value once it is truthy, polled every 0.2 s; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:g} s")
        time.sleep(0.2)
    return value


def _run(http: httpx.Client, args: argparse.Namespace, *, restartable: bool, kill: bool) -> dict[str, Any]:
    job = http.post("/v1/jobs", json={
        "name": "bench-handover", "num_nodes": 2, "gpus_per_node": 1, "entrypoint": "tests/e2e/restartable_job.py",
        "args": [str(args.steps), str(args.step_delay_s)], "checkpoint": {"interval_steps": 10}, "max_failures": 3,
        "restartable": restartable,
    }).raise_for_status().json()
    if kill:
        wait_for("committed checkpoint", lambda: [
            c for c in http.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"] if c["state"] == "committed"], 180)
        first = http.get(f"/v1/jobs/{job['id']}/attempts").json()["items"][-1]
        (victim,) = [w["pid"] for n in first["nodes"] if n["node_rank"] == 1 for w in n["workers"]]
        os.kill(victim, signal.SIGKILL)
    view = wait_for("end", lambda: (v := http.get(f"/v1/jobs/{job['id']}").json())["state"]
                 in ("succeeded", "failed", "cancelled") and v, 600)
    if view["state"] != "succeeded":
        raise RuntimeError(f"the job ended {view['state']}: {view['end_reason']}")
    out: dict[str, Any] = {"weights_sha256": view["result"]["weights_sha256"]}
    if kill:
        attempts = http.get(f"/v1/jobs/{job['id']}/attempts").json()["items"]
        rec = attempts[-1]["recovery"]
        healthy = [n for n in attempts[0]["nodes"] if n["node_rank"] == 0][0]
        later = {n["node_name"]: n for n in attempts[-1]["nodes"]}[healthy["node_name"]]
        out.update({f"{p}_s": rec[f"{p}_s"] for p in PHASES}, total_s=rec["to_first_step_s"],
                   kept=[w["pid"] for w in later["workers"]] == [w["pid"] for w in healthy["workers"]])
    return out


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=250)
    parser.add_argument("--step-delay-s", type=float, default=0.04)
    parser.add_argument("--repeat", type=int, default=1, help="killed runs of each row; the table shows medians")
    args = parser.parse_args()
    runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as tmp:
        config = DevConfig(nodes=2, gpus_per_node=1, port=free_port(), data_dir=Path(tmp) / "cluster")
        with (Path(tmp) / "dev.log").open("w") as log:
            dev = DevCluster(config, log)
            try:
                dev.start()
                http = httpx.Client(base_url=config.api_url, headers={"Authorization": f"Bearer {dev.token}"},
                                    timeout=30, verify=dev.verify)
                print(f"reference run (no failure), {args.steps} steps ...", flush=True)
                reference = _run(http, args, restartable=False, kill=False)["weights_sha256"]
                for i in range(args.repeat):
                    for name, restartable in ROWS:
                        print(f"[{i + 1}/{args.repeat}] {name}: node rank 1's worker killed ...", flush=True)
                        runs[restartable].append(_run(http, args, restartable=restartable, kill=True))
                http.close()
            finally:
                dev.stop()
    cold = _median(runs[False], "total_s")
    print(f"\nfailure -> first new step and its phases (medians of {args.repeat}; ratio: against the cold restart "
          "of the same job):\n")
    print("| | failure -> first new step | ratio | " + " | ".join(p.replace("_", " ") for p in PHASES)
          + " | healthy rank's process kept | weights exact |")
    print("| --- " * (len(PHASES) + 5) + "|")
    for name, restartable in ROWS:
        rows = runs[restartable]
        total = _median(rows, "total_s")
        ratio = "-" if total is None or not cold else f"{total / cold:.2f}"
        kept = "yes" if all(r["kept"] for r in rows) else "no"
        exact = "yes" if all(r["weights_sha256"] == reference for r in rows) else "NO"
        print("| " + " | ".join([name, _fmt(total), ratio, *(_fmt(_median(rows, f"{p}_s")) for p in PHASES),
                                 kept, exact]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
