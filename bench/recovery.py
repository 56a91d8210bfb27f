"""Recovery benchmark: how long a job takes to come back after a worker dies, and what it loses.

    .venv/bin/python bench/recovery.py [--steps 120] [--interval 20] [--crash-at-step 50] [--repeat 1]
                                       [--only SUBSTRING]

Every run is the same workload, tiny_gpt on 2 ranks, checkpointing every ``--interval`` steps,
with rank 1 SIGKILLed at ``--crash-at-step`` (first attempt only), in this same run:

- **Trainyard**, once per row of ``VARIANTS``: a dev cluster on this machine (embedded PostgreSQL
  and S3, agents on 127.0.0.2, .3, ..., 1 virtual GPU each); checkpoints go to S3 in two phases,
  the control plane fails the attempt and gang-allocates a new one that restores the last committed
  checkpoint. Each row switches recovery mechanisms on or off (a job, control-plane or agent
  setting); adding a mechanism is one line there. The phases come from the job view
  (``GET /v1/jobs/{id}/attempts``, ``recovery``: docs/architecture.md, "Recovery phases").
- **In-process restart** (a row with ``restartable: true`` and tiny_gpt ``--restartable``): node
  rank 0's worker is not stopped: its agent parks it, the control plane hands its GPU over to the
  next attempt, and it restarts in its own process, restoring from its own memory; only rank 1
  starts a new process (docs/architecture.md, "In-process restart of healthy ranks"). Its
  "failure -> new worker processes" is the replaced rank's new process (the healthy rank never
  needs one; its shim's ``started_at`` is the first attempt's), and the "process start" phase ends
  when the new attempt's every rank runs, the kept one included. The table says whether the
  healthy rank kept its process.
- **Node replacement** (a row with ``replace_node``): 3 agents for the 2-node job; the moment rank
  1 dies, its node's agent and every process under it are SIGKILLed too, and the node never comes
  back, so the job must resume on the spare node.
- **torchrun + DCP** (the baseline a user would otherwise pick): ``torchrun --standalone
  --max-restarts 3`` restarting the worker group in place, ``torch.distributed.checkpoint`` to
  local disk (bench/torchrun_dcp_worker.py); the phases come from the workers' own timeline. It has
  no answer to a lost node: its restarts happen on the same hosts, from their local disks.

Every run must end with the weights of a run that never failed; the script checks it. Ratios are
against torchrun's in-place restart (below 1: Trainyard is faster); the targets (issue 30) are
0.5x for an in-place recovery and 1.0x for a node replacement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.dev import DevCluster, DevConfig  # noqa: E402
from trainyard.embedded import free_port  # noqa: E402

PHASES = ("detection", "decision", "wake_up", "process_start", "rendezvous", "restore")


@dataclass(frozen=True)
class Variant:
    """One Trainyard row: which recovery mechanisms are on, as the settings that switch them."""

    name: str
    job: dict[str, Any] = field(default_factory=dict)
    """Merged into the job body (a per-job switch)."""
    control_plane_env: dict[str, str] = field(default_factory=dict)
    """TRAINYARD_* settings of the control plane."""
    agent_args: tuple[str, ...] = ()
    """Extra arguments for every agent."""
    script_args: tuple[str, ...] = ()
    """Extra arguments for tiny_gpt."""
    nodes: int = 2
    replace_node: bool = False
    """The killed rank's node is gone for good (its agent and processes killed): the job comes back
    on a spare node (``nodes`` must leave one)."""
    in_place: bool = True
    """Compared with the 0.5x target (in-place recovery) rather than the 1.5x one (node replaced)."""


_NO_MEMORY_TIER = ("--memory-tier-mb", "0")
_NO_STANDBYS = ("--standbys", "0")

VARIANTS: tuple[Variant, ...] = (
    # Push wake-ups off: no long poll is admitted (each is answered 503), so agents learn of the new
    # attempt from their next heartbeat; with the memory tier and standbys off too, this is recovery
    # before issue 14.
    Variant("push wake-ups off, memory tier off, standbys off", control_plane_env={"TRAINYARD_AGENT_WAIT_MAX": "0"},
            agent_args=(*_NO_MEMORY_TIER, *_NO_STANDBYS)),
    Variant("push wake-ups on, memory tier off, standbys off", agent_args=(*_NO_MEMORY_TIER, *_NO_STANDBYS)),
    Variant("push wake-ups + memory tier, standbys off", agent_args=_NO_STANDBYS),
    # The agent's default keeps one warm standby per GPU and one for torchrun (--standbys auto).
    Variant("push wake-ups + memory tier + warm standbys (default)"),
    Variant("in-process restart (restartable: true)", job={"restartable": True}, script_args=("--restartable",)),
    Variant("node replaced (3 nodes; rank 1's node gone)", nodes=3, replace_node=True, in_place=False),
)


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


def run_trainyard(args: argparse.Namespace, workdir: Path, variant: Variant) -> dict[str, Any]:
    config = DevConfig(nodes=variant.nodes, gpus_per_node=1, port=free_port(), data_dir=workdir / "cluster",
                       control_plane_env=dict(variant.control_plane_env), agent_args=list(variant.agent_args))
    log = (workdir / "dev.log").open("w")
    dev = DevCluster(config, log)
    killed_at: float | None = None
    try:
        dev.start()
        http = httpx.Client(base_url=config.api_url, headers={"Authorization": f"Bearer {dev.token}"}, timeout=30,
                            verify=dev.verify)
        job = http.post("/v1/jobs", json={
            "name": "bench-recovery", "num_nodes": 2, "gpus_per_node": 1,
            "entrypoint": "worker_runtime.examples.tiny_gpt",
            "args": ["--steps", str(args.steps), "--step-delay-s", str(args.step_delay_s),
                     "--crash-at-step", str(args.crash_at_step), "--crash-rank", "1", "--crash-kill", "--crash-once",
                     *variant.script_args],
            "checkpoint": {"interval_steps": args.interval, "keep_last": 100}, "max_failures": 3,
            **variant.job,
        }).raise_for_status().json()
        if variant.replace_node:
            killed_at = _kill_node_with_rank_1(dev, http, job["id"])
        deadline = time.monotonic() + 600
        while (view := http.get(f"/v1/jobs/{job['id']}").json())["state"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError("the Trainyard job did not end within 600 s")
            time.sleep(0.5)
        if view["state"] != "succeeded":
            raise RuntimeError(f"the Trainyard job ended {view['state']}: {view['end_reason']}")
        attempts = http.get(f"/v1/jobs/{job['id']}/attempts").json()["items"]
        (workdir / "attempts.json").write_text(json.dumps(attempts, indent=1))  # with --keep, these stay
        (workdir / "job.log").write_text(http.get(f"/v1/jobs/{job['id']}/logs").text)
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
    phases = {p: rec[f"{p}_s"] for p in PHASES}
    if killed_at is not None:
        # The dead node never reported its worker's exit: the view's failure is the survivor's report,
        # later than the kill (this process's clock, the same machine's). The gap is detection too.
        failure = min(killed_at, failure or killed_at)
        phases["detection"] = (phases["detection"] or 0.0) + _ts(rec["failure_at"]) - failure  # type: ignore[operator]
    # New processes only: a worker handed over (in-process restart) keeps its pid and the first attempt's
    # started_at.
    old_pids = {w["pid"] for n in failed["nodes"] for w in n["workers"]}
    workers = [w for n in second["nodes"] for w in n["workers"]]
    kept = [w for w in workers if w["pid"] in old_pids]
    started = min(_ts(w["started_at"]) for w in workers if w not in kept)  # type: ignore[type-var]
    first_step = _ts(rec["failure_at"]) + rec["to_first_step_s"]  # type: ignore[operator]
    stats = view["result"].get("checkpoint_stats", {})
    old_nodes = {n["node_name"] for n in failed["nodes"]}
    return {
        "weights_sha256": view["result"]["weights_sha256"],
        "attempts": len(attempts),
        "new_nodes": sorted({n["node_name"] for n in second["nodes"]} - old_nodes),
        "kept_processes": len(kept),
        "to_processes_s": started - failure,  # type: ignore[operator]
        "to_first_step_after_start_s": first_step - started,
        "total_s": first_step - failure,  # type: ignore[operator]
        "steps_lost": args.crash_at_step - (second["restored_from_step"] or 0),
        **{f"{p}_s": v for p, v in phases.items()},
        "over_budget": [o["phase"] for o in rec["over_budget"]],
        "pause_s": stats.get("mean_pause_s"), "upload_s": stats.get("mean_upload_s"),
        "bytes": statistics.median(c["size_bytes"] for c in committed) if committed else None,
    }


def _kill_node_with_rank_1(dev: DevCluster, http: httpx.Client, job_id: str) -> float:
    """Wait for rank 1 to die (tiny_gpt's --crash-at-step), then kill its whole node at once (the
    agent and everything under it, SIGKILL) and never start it again. Returns the worker's death
    (this process's clock), within the 5 ms poll."""
    deadline = time.monotonic() + 300
    pid, node = None, None
    while pid is None:
        if time.monotonic() > deadline:
            raise RuntimeError("rank 1 never ran")
        for part in (http.get(f"/v1/jobs/{job_id}/attempts").json()["items"] or [{}])[0].get("nodes", []):
            for w in part["workers"]:
                if w["rank"] == 1 and w["pid"] and w["state"] == "running":
                    pid, node = w["pid"], part["node_name"]
        time.sleep(0.2)
    try:
        proc = psutil.Process(pid)
        while proc.status() != psutil.STATUS_ZOMBIE:
            if time.monotonic() > deadline:
                raise RuntimeError("rank 1 did not crash")
            time.sleep(0.005)
    except psutil.NoSuchProcess:
        pass
    died = time.time()
    assert node is not None
    dev.node_action("kill", node)
    return died


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
    initialised = next(e for e in events if e["event"] == "initialised" and e["restart"] == 1)
    first = next(e for e in events if e["event"] == "first_step" and e["restart"] == 1)
    saves = [e for e in events if e["event"] == "save"]
    done = next(e for e in events if e["event"] == "done")
    return {
        "weights_sha256": done["weights_sha256"],
        "attempts": 2,
        "to_processes_s": start["process_started"] - crash["t"],
        "to_first_step_after_start_s": first["t"] - start["process_started"],
        "total_s": first["t"] - crash["t"],
        # torchrun's agent detects, decides and restarts in one: all of it up to the new processes.
        "process_start_s": start["process_started"] - crash["t"],
        "rendezvous_s": initialised["t"] - start["process_started"],
        "restore_s": first["t"] - initialised["t"],
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


@contextlib.contextmanager
def _workdir(args: argparse.Namespace) -> Iterator[str]:
    """A run's directory: a temporary one, or with ``--keep`` one that stays (named in the output)."""
    if args.keep is None:
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            yield tmp
        return
    args.keep.mkdir(parents=True, exist_ok=True)
    kept = tempfile.mkdtemp(prefix="run-", dir=args.keep)
    print(f"  (kept in {kept})", flush=True)
    yield kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=20)
    parser.add_argument("--crash-at-step", type=int, default=50)
    parser.add_argument("--step-delay-s", type=float, default=0.05)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row; the tables show medians")
    parser.add_argument("--only", default="",
                        help="run only the Trainyard rows whose name contains this (or one of A|B|...)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each run's directory (the cluster's logs, the attempts' files) under this one")
    args = parser.parse_args()
    if not 0 < args.interval < args.crash_at_step < args.steps:
        parser.error("need 0 < --interval < --crash-at-step < --steps")
    variants = [v for v in VARIANTS if any(part in v.name for part in args.only.split("|"))]
    if not variants:
        parser.error(f"no row matches --only {args.only!r}: {', '.join(v.name for v in VARIANTS)}")

    print(f"reference run (no failure), {args.steps} steps ...", flush=True)
    reference = run_reference(args)
    ours: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    theirs: list[dict[str, Any]] = []
    for i in range(args.repeat):
        for v in variants:
            with _workdir(args) as tmp:
                print(f"[{i + 1}/{args.repeat}] Trainyard, {v.name}: rank 1 killed at step {args.crash_at_step}",
                      flush=True)
                ours[v.name].append(run_trainyard(args, Path(tmp), v))
        with _workdir(args) as tmp:
            print(f"[{i + 1}/{args.repeat}] torchrun --max-restarts 3 + DCP to local disk ...", flush=True)
            theirs.append(run_baseline(args, Path(tmp)))
    base = _median(theirs, "total_s")

    print(f"\nfailure -> first new step and its phases (medians of {args.repeat}; ratio: against torchrun's in-place "
          "restart):\n")
    print("| | failure -> first new step | ratio | target | detection | decision | wake-up | process start "
          "| rendezvous | restore | steps lost | processes kept | weights exact |")
    print("| --- " * 13 + "|")
    for v in variants:
        runs = ours[v.name]
        total = _median(runs, "total_s")
        ratio = total / base if total is not None and base else None
        target = 0.5 if v.in_place else 1.0
        verdict = "-" if ratio is None else f"{'met' if ratio <= target else 'MISSED'} ({target}x)"
        moved = "" if v.in_place else f" (on {', '.join(runs[-1]['new_nodes']) or '?'})"
        cells = [f"Trainyard, {v.name}{moved}", _fmt(total, "s"), _ratio(ratio), verdict,
                 *(_fmt(_median(runs, f"{p}_s"), "s") for p in PHASES), _fmt(_median(runs, "steps_lost"), ""),
                 _kept(runs), _exact(runs, reference)]
        print("| " + " | ".join(cells) + " |")
    cells = ["torchrun --max-restarts + DCP, in place", _fmt(base, "s"), "1.00", "baseline", "-", "-", "-",
             _fmt(_median(theirs, "process_start_s"), "s") + " (failure -> new processes)",
             _fmt(_median(theirs, "rendezvous_s"), "s"), _fmt(_median(theirs, "restore_s"), "s"),
             _fmt(_median(theirs, "steps_lost"), ""), "0 of 2", _exact(theirs, reference)]
    print("| " + " | ".join(cells) + " |")
    print("| torchrun, node replaced | cannot | - | - | - | - | - | - | - | - | - | - | - |")
    print("\ntorchrun restarts its workers on the same hosts only: when a node is gone, the job needs a new torchrun "
          "on a new host and a checkpoint that host can read; nothing in torchrun does either.")
    for v in variants:
        over = sorted({p for r in ours[v.name] for p in r["over_budget"]})
        if over:
            print(f"{v.name}: over the cluster's recovery budget in {', '.join(over)}")

    # The checkpoint costs and the coarse split of the first table of this script, for the plainest row
    # (no switch set: what a job gets by default).
    plain = next((v for v in variants
                  if not (v.job or v.control_plane_env or v.agent_args or v.script_args or v.replace_node)),
                 variants[0])
    first = ours[plain.name]
    rows = (
        ("failure -> new worker processes", "to_processes_s", "s"),
        ("new processes -> first step after restore", "to_first_step_after_start_s", "s"),
        ("checkpoint: training paused per save", "pause_s", "s"),
        ("checkpoint: background upload per save", "upload_s", "s"),
        ("checkpoint: bytes per checkpoint (all ranks)", "bytes", "B"),
    )
    print(f"\n{'(' + plain.name + ')':<46} {'Trainyard':>12} {'torchrun+DCP':>14} {'ratio':>7}")
    for label, key, unit in rows:
        a, b = _median(first, key), _median(theirs, key)
        ratio = _ratio(a / b if a is not None and b else None)
        print(f"{label:<46} {_fmt(a, unit):>12} {_fmt(b, unit):>14} {ratio:>7}")
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _kept(runs: list[dict[str, Any]]) -> str:
    """How many of the 2 ranks kept their process into the new attempt (the fewest over the runs)."""
    return f"{min(r['kept_processes'] for r in runs)} of 2"


def _exact(runs: list[dict[str, Any]], reference: str) -> str:
    return "yes" if all(r["weights_sha256"] == reference for r in runs) else "NO"


if __name__ == "__main__":
    raise SystemExit(main())
