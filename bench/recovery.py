"""Recovery benchmark: how long a job takes to come back after a worker dies, and what it loses.

    .venv/bin/python bench/recovery.py [--steps 120] [--interval 20] [--crash-at-step 50] [--repeat 1]

Both sides run the same workload, tiny_gpt on 2 ranks, checkpointing every ``--interval`` steps,
with rank 1 SIGKILLing itself at ``--crash-at-step`` (first run only), in this same run:

- **Trainyard**: a dev cluster on this machine (embedded PostgreSQL and S3, 2 agents on 127.0.0.2/3,
  1 virtual GPU each); checkpoints go to S3 in two phases, the control plane fails the attempt and
  gang-allocates a new one that restores the last committed checkpoint. The phases come from the
  job view (``GET /v1/jobs/{id}/attempts``, ``recovery``).
- **torchrun + DCP** (the baseline a user would otherwise pick): ``torchrun --standalone
  --max-restarts 3`` restarting the worker group in place, ``torch.distributed.checkpoint`` to
  local disk (bench/torchrun_dcp_worker.py); the phases come from the workers' own timeline.

Both must end with the weights of a run that never failed; the script checks it. The last table
compares the two, with the ratio Trainyard / baseline (below 1: Trainyard is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev import DevCluster, DevConfig  # noqa: E402
from trainyard.embedded import free_port  # noqa: E402


def _ts(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def run_reference(args: argparse.Namespace) -> str:
    """weights_sha256 of tiny_gpt with no failure (bare torchrun, 2 ranks)."""
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "worker_runtime.examples.tiny_gpt", "--steps", str(args.steps)],
        env={**_env(), "TRAINYARD_DEVICE": "cpu"}, capture_output=True, text=True, timeout=600, cwd=ROOT, check=True,
    ).stdout
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["weights_sha256"]


def run_trainyard(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    config = DevConfig(nodes=2, gpus_per_node=1, port=free_port(), data_dir=workdir / "cluster")
    log = (workdir / "dev.log").open("w")
    dev = DevCluster(config, log)
    try:
        dev.start()
        http = httpx.Client(base_url=config.api_url, headers={"Authorization": f"Bearer {dev.token}"}, timeout=30,
                            verify=dev.verify)
        job = http.post("/v1/jobs", json={
            "name": "bench-recovery", "num_nodes": 2, "gpus_per_node": 1,
            "entrypoint": "worker_runtime.examples.tiny_gpt",
            "args": ["--steps", str(args.steps), "--step-delay-s", str(args.step_delay_s),
                     "--crash-at-step", str(args.crash_at_step), "--crash-rank", "1", "--crash-kill", "--crash-once"],
            "checkpoint": {"interval_steps": args.interval, "keep_last": 100}, "max_failures": 3,
        }).raise_for_status().json()
        deadline = time.monotonic() + 600
        while (view := http.get(f"/v1/jobs/{job['id']}").json())["state"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError("the Trainyard job did not end within 600 s")
            time.sleep(0.5)
        if view["state"] != "succeeded":
            raise RuntimeError(f"the Trainyard job ended {view['state']}: {view['end_reason']}")
        attempts = http.get(f"/v1/jobs/{job['id']}/attempts").json()["items"]
        checkpoints = http.get(f"/v1/jobs/{job['id']}/checkpoints").json()["items"]
        committed = [c for c in checkpoints if c["state"] == "committed"]
        http.close()
    finally:
        dev.stop()
        log.close()
    failed, second = attempts[0], attempts[-1]
    rec = second["recovery"]
    crashed = [w for n in failed["nodes"] for w in n["workers"] if w["exit_code"] == -9]
    failure = _ts(crashed[0]["ended_at"]) if crashed else _ts(rec["failure_at"])
    started = min(_ts(w["started_at"]) for n in second["nodes"] for w in n["workers"])  # type: ignore[type-var]
    first_step = _ts(rec["failure_at"]) + rec["to_first_step_s"]  # type: ignore[operator]
    stats = view["result"].get("checkpoint_stats", {})
    return {
        "weights_sha256": view["result"]["weights_sha256"],
        "attempts": len(attempts),
        "to_processes_s": started - failure,  # type: ignore[operator]
        "to_first_step_after_start_s": first_step - started,
        "total_s": first_step - failure,  # type: ignore[operator]
        "steps_lost": args.crash_at_step - (second["restored_from_step"] or 0),
        "detection_s": rec["detection_s"], "reallocation_s": rec["reallocation_s"],
        "start_s": rec["start_s"], "restore_s": rec["restore_s"],
        "pause_s": stats.get("mean_pause_s"), "upload_s": stats.get("mean_upload_s"),
        "bytes": statistics.median(c["size_bytes"] for c in committed) if committed else None,
    }


def run_baseline(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    timeline = workdir / "timeline.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "3", str(ROOT / "bench" / "torchrun_dcp_worker.py"),
           "--ckpt-dir", str(workdir / "ckpt"), "--timeline", str(timeline), "--steps", str(args.steps),
           "--interval", str(args.interval), "--step-delay-s", str(args.step_delay_s),
           "--crash-at-step", str(args.crash_at_step), "--crash-rank", "1"]
    with (workdir / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    if code != 0:
        raise RuntimeError(f"torchrun exited with {code}; log: {workdir / 'torchrun.log'}")
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    crash = next(e for e in events if e["event"] == "crash")
    start = next(e for e in events if e["event"] == "start" and e["restart"] == 1)
    restored = next(e for e in events if e["event"] == "restored" and e["restart"] == 1)
    first = next(e for e in events if e["event"] == "first_step" and e["restart"] == 1)
    saves = [e for e in events if e["event"] == "save"]
    done = next(e for e in events if e["event"] == "done")
    return {
        "weights_sha256": done["weights_sha256"],
        "attempts": 2,
        "to_processes_s": start["process_started"] - crash["t"],
        "to_first_step_after_start_s": first["t"] - start["process_started"],
        "total_s": first["t"] - crash["t"],
        "steps_lost": crash["step"] - restored["step"],
        "pause_s": statistics.mean(e["pause_s"] for e in saves),
        "upload_s": 0.0,
        "bytes": statistics.median(e["bytes"] for e in saves),
    }


def _median(runs: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(value: Any, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "B":
        return f"{value / 1e6:.2f} MB"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:g}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--crash-at-step", type=int, default=50)
    parser.add_argument("--step-delay-s", type=float, default=0.05)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each side; the tables show medians")
    args = parser.parse_args()
    if not 0 < args.interval < args.crash_at_step < args.steps:
        parser.error("need 0 < --interval < --crash-at-step < --steps")

    print(f"reference run (no failure), {args.steps} steps ...", flush=True)
    reference = run_reference(args)
    ours, theirs = [], []
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            print(f"[{i + 1}/{args.repeat}] Trainyard, rank 1 killed at step {args.crash_at_step}", flush=True)
            ours.append(run_trainyard(args, Path(tmp)))
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            print(f"[{i + 1}/{args.repeat}] torchrun --max-restarts 3 + DCP to local disk ...", flush=True)
            theirs.append(run_baseline(args, Path(tmp)))
    for name, runs in (("Trainyard", ours), ("torchrun+DCP", theirs)):
        exact = all(r["weights_sha256"] == reference for r in runs)
        print(f"{name}: final weights equal the unbroken run's: {'yes' if exact else 'NO'}")

    print("\nTrainyard recovery phases (median, from the job view):")
    for key, label in (("detection_s", "failure -> attempt failed"), ("reallocation_s", "failed -> new gang allocated"),
                       ("start_s", "allocated -> every worker running"),
                       ("restore_s", "running -> first step reported (restore + 1 step)")):
        print(f"  {label:<52} {_fmt(_median(ours, key), 's'):>10}")

    rows = (
        ("failure -> new worker processes", "to_processes_s", "s"),
        ("new processes -> first step after restore", "to_first_step_after_start_s", "s"),
        ("failure -> first new step (recovery time)", "total_s", "s"),
        ("steps lost", "steps_lost", ""),
        ("checkpoint: training paused per save", "pause_s", "s"),
        ("checkpoint: background upload per save", "upload_s", "s"),
        ("checkpoint: bytes per checkpoint (all ranks)", "bytes", "B"),
    )
    print(f"\n{'':<46} {'Trainyard':>12} {'torchrun+DCP':>14} {'ratio':>7}")
    for label, key, unit in rows:
        a, b = _median(ours, key), _median(theirs, key)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        print(f"{label:<46} {_fmt(a, unit):>12} {_fmt(b, unit):>14} {ratio:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
