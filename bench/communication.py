"""Communication benchmark: measured step time and communication share of the runtime's layouts
against the planner's prediction, calibrated in the same run.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/communication.py [--steps 8]

1, 2 and 4 gloo workers (CPU) on 1 and 2 "nodes" (two torchrun instances on 127.0.0.1 and
127.0.0.2 with a static rendezvous, node rank 0 hosting it, as the node agent launches them), each
running bench/communication_worker.py: TinyGPT (d_model 256, 2 layers, 1.65 M parameters, 64
tokens per rank per micro-step) under ``worker_runtime.layouts.apply_layout``, measured by the
runtime's own meter (worker_runtime/comm_meter.py). Each world first calibrates itself: the FLOP
rate of a matmul of the model's MLP shape with every rank computing at once, and an all-reduce
sweep (4 KiB to 8 MiB) fitted to the alpha-beta model of a ring all-reduce.

The prediction is the planner's (``control_plane.planning.estimate``), calibrated with this
world's figures: the matmul's FLOP rate as the peak, the MFU of this model on this world's CPU
share measured in the same run (its step without collectives, every rank at once), the fitted
alpha and bandwidth for both link classes (all loopback). Its formulas: compute 6 x parameters x
tokens / (peak x MFU); a ring all-reduce of B bytes on n ranks 2(n-1) alpha + 2(n-1)/n B / bw, an
all-gather or reduce-scatter half of it; DDP all-reduces the gradients once per optimizer step in
buckets (bf16/fp16: half the bytes; PowerSGD: its factors); FSDP gathers every unit's weights in
forward and again in backward on every micro-step and reduce-scatters the gradients once; HSDP
does that inside a node and all-reduces its shard across nodes. Two choices for this machine:
- the planner's figure without overlap: gloo on CPU runs FSDP2's collectives synchronously, and
  DDP's one bucket is launched when the backward ends;
- plus the wait for the slowest rank, measured after the collective-free step (the planner leaves
  stragglers out): the ranks share 2 cores (with each other and whatever else runs), reach a
  collective apart, and the first collective of a step absorbs the difference.
The bytes table sets the meter's count (each collective's payload) beside the textbook payload
(``predict``; the planner's traffic is the ring's share of it).

Printed: the calibration per world, the step time and communication share (exposed communication /
step) measured and predicted with the relative error (target: within 25%), and, on 4 workers on 2
nodes, the effect of accumulation and compression on the bytes each rank passes to collectives per
optimizer step and on the step time. Takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from control_plane.planning.estimate import Row, estimate  # noqa: E402
from control_plane.planning.hardware import Hardware, Link  # noqa: E402
from control_plane.planning.workload import TransformerShape, Workload, bytes_per_param  # noqa: E402
from trainyard.embedded import free_port  # noqa: E402
from trainyard.protocol.layout import Layout  # noqa: E402

TOPOLOGIES = ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2))
"""(workers, nodes)."""
BASE: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "ddp, accum 4": {"kind": "ddp", "grad_accum_steps": 4},
}
EXTRA: dict[str, dict[str, Any]] = {
    "ddp, fp16": {"kind": "ddp", "compression": "fp16"},
    "ddp, bf16": {"kind": "ddp", "compression": "bf16"},
    "ddp, powersgd r1": {"kind": "ddp", "compression": "powersgd"},
    "fsdp, accum 4": {"kind": "fsdp", "grad_accum_steps": 4},
    "hsdp 2x2": {"kind": "hsdp"},
}
"""Layouts measured on the largest world only (4 workers on 2 nodes)."""
LIKE = {"ddp, fp16": "ddp", "ddp, bf16": "ddp", "ddp, powersgd r1": "ddp", "fsdp, accum 4": "fsdp", "hsdp 2x2": "fsdp"}
"""The baseline layout whose 1-worker compute overhead an extra layout is taken to have."""
TARGET = 0.25
MODEL = {"vocab": 256, "seq": 32, "batch": 2, "d_model": 256, "layers": 2, "heads": 4}
"""TinyGPT's shape and the batch per rank per micro-step (bench/communication_worker.py)."""


def _env(ifname: str = "lo") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=ifname, TRAINYARD_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def run_world(workers: int, nodes: int, layouts: dict[str, Any], args: argparse.Namespace, *,
              hosts: list[str] | None = None, prefixes: list[list[str]] | None = None,
              ifname: str = "lo", extra: list[str] | None = None) -> dict[str, Any]:
    """One world: a torchrun per node, static rendezvous on node rank 0; rank 0's JSON line.
    ``hosts``: each node's address (127.0.0.1, 127.0.0.2, ... by default); ``prefixes``: the command
    that runs each node's torchrun where that node lives (a network namespace: bench/shaped_links.py),
    whose interface ``ifname`` gloo then uses."""
    port, per_node = free_port(), workers // nodes
    hosts = hosts or [f"127.0.0.{i + 1}" for i in range(nodes)]
    prefixes = prefixes or [[] for _ in range(nodes)]
    spec = json.dumps([{"name": name, "layout": layout} for name, layout in layouts.items()])
    procs = []
    try:
        for node_rank in range(nodes):
            cmd = [*prefixes[node_rank], sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--nproc-per-node", str(per_node), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                   "--rdzv-endpoint", f"{hosts[0]}:{port}", "--rdzv-id", "bench-communication",
                   "--local-addr", hosts[node_rank], "--max-restarts", "0",
                   str(ROOT / "bench" / "communication_worker.py"), "--layouts", spec,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *[f"--{k.replace('_', '-')}={v}" for k, v in MODEL.items()], *(extra or [])]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(ifname), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, start_new_session=True))
        outputs = [p.communicate(timeout=args.timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    for p, (_, err) in zip(procs, outputs, strict=True):
        if p.returncode:
            raise SystemExit(f"{workers} workers on {nodes} nodes failed ({p.returncode}):\n{err[-3000:]}")
    lines = [line for line in outputs[0][0].splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


# --- the prediction ---------------------------------------------------------------------------


def fit_alpha_beta(sweep: list[list[float]], n: int) -> tuple[float, float]:
    """Least squares of t = 2(n-1) alpha + 2(n-1)/n B / bw over the sweep: (alpha s, bw B/s)."""
    xs = [(2.0 * (n - 1), 2.0 * (n - 1) / n * b) for b, _ in sweep]
    ts = [t for _, t in sweep]
    s11 = sum(a * a for a, _ in xs)
    s12 = sum(a * b for a, b in xs)
    s22 = sum(b * b for _, b in xs)
    r1 = sum(a * t for (a, _), t in zip(xs, ts, strict=True))
    r2 = sum(b * t for (_, b), t in zip(xs, ts, strict=True))
    det = s11 * s22 - s12 * s12
    alpha, inv_bw = (s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det
    return max(alpha, 0.0), 1.0 / max(inv_bw, 1e-15)


def all_reduce_s(nbytes: float, n: int, alpha: float, bw: float, calls: int = 1) -> float:
    return 0.0 if n < 2 else calls * 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def gather_s(nbytes: float, n: int, alpha: float, bw: float, calls: int = 1) -> float:
    """An all-gather or a reduce-scatter of ``nbytes`` (the unsharded size) in ``calls`` collectives."""
    return 0.0 if n < 2 else calls * (n - 1) * alpha + (n - 1) / n * nbytes / bw


def powersgd_bytes(shapes: list[list[int]], rank: int = 1) -> float:
    total = 0
    for shape in shapes:
        rows, cols = shape[0], (shape[1] if len(shape) > 1 else 1)
        for d in shape[2:]:
            cols *= d
        compressed = (rows + cols) * rank
        total += compressed if len(shape) > 1 and compressed * 2 < rows * cols else rows * cols
    return 4.0 * total


def planner_row(layout: dict[str, Any], m: dict[str, Any], world: dict[str, Any], calib: dict[str, float],
                intra: dict[str, float] | None = None) -> Row:
    """The planner's row (control_plane/planning) for this world, calibrated: the matmul's FLOP rate
    as the peak, the model's measured MFU, the fitted all-reduce alpha and bandwidth for both link
    classes (``calib``'s for both, loopback; or ``intra``'s inside a node), the run's fp32 AdamW."""
    n, local = world["world_size"], world["local_world_size"]
    link = Link(name="inter", bytes_per_s=min(calib["bw"], 1e15), latency_s=calib["alpha"])
    inside = link if intra is None else Link(name="intra", bytes_per_s=min(intra["bw"], 1e15),
                                             latency_s=intra["alpha"])
    hw = Hardware(gpu_kind="cpu", memory_bytes=24e9, peak_flops=world["flops"], gpus_per_node=local,
                  intra=inside, inter=link)
    shape = TransformerShape(layers=MODEL["layers"], hidden=MODEL["d_model"], vocab=MODEL["vocab"],
                             heads=MODEL["heads"])
    accum = layout.get("grad_accum_steps", 1)
    w = Workload(params=m["params"], bytes=bytes_per_param("fp32", "adamw"), seq_len=MODEL["seq"],
                 global_batch=MODEL["batch"] * n * accum, micro_batch=MODEL["batch"], shape=shape,
                 mfu=min(calib["mfu"], 1.0))
    return estimate(w, hw, Layout.model_validate(layout), n)


def predict(layout: dict[str, Any], m: dict[str, Any], world: dict[str, Any],
            calib: dict[str, float]) -> dict[str, float]:
    """The textbook payload: bytes per rank per optimizer step passed to collectives (what the
    meter counts; the planner's traffic is the ring's share of it), and its seconds."""
    n, local = world["world_size"], world["local_world_size"]
    alpha, bw, mfu, wait = calib["alpha"], calib["bw"], calib["mfu"], calib["wait"]
    grad = 4.0 * m["params"]
    accum = layout.get("grad_accum_steps", 1)
    compute = 6.0 * m["params"] * m["tokens_per_rank"] / (world["flops"] * mfu)
    kind, compression = layout["kind"], layout.get("compression", "none")
    if kind == "ddp":
        payload = {"none": grad, "fp16": grad / 2, "bf16": grad / 2,
                   "powersgd": powersgd_bytes(m["shapes"])}[compression]
        buckets = math.ceil(grad / (layout.get("ddp_bucket_mb", 25.0) * 2**20))
        calls = buckets * (3 if compression == "powersgd" else 1)  # PowerSGD: P, Q and the raw tensors
        return {"bytes": payload, "compute": compute, "comm": wait + all_reduce_s(payload, n, alpha, bw, calls)}
    blocks = [4.0 * u for u in m["unit_params"]]
    root = grad - sum(blocks)
    gathered = accum * (2 * sum(blocks) + root)  # every micro-step: forward and backward (the root once)
    gathers = accum * (2 * len(blocks) + 1)
    if kind == "fsdp":
        comm = gather_s(gathered, n, alpha, bw, gathers) + gather_s(grad, n, alpha, bw, len(blocks) + 1)
        return {"bytes": gathered + grad, "compute": compute, "comm": wait + comm}
    shard = layout.get("shard_size") or local  # hsdp
    replicas = n // shard
    comm = (gather_s(gathered, shard, alpha, bw, gathers) + gather_s(grad, shard, alpha, bw, len(blocks) + 1)
            + all_reduce_s(grad / shard, replicas, alpha, bw, len(blocks) + 1))
    return {"bytes": gathered + grad + grad / shard, "compute": compute, "comm": wait + comm}


# --- the tables --------------------------------------------------------------------------------


HITS: list[bool] = []


def with_overhead(calib: dict[str, float], overhead: float) -> dict[str, float]:
    return {**calib, "mfu": calib["mfu"] / overhead}


def planned(layout: dict[str, Any], m: dict[str, Any], world: dict[str, Any],
            calib: dict[str, float], intra: dict[str, float] | None = None) -> tuple[float, float]:
    """(step, exposed communication) seconds: the planner's row without overlap (gloo on CPU runs
    FSDP2's collectives synchronously and DDP's one bucket after the backward: nothing overlaps),
    plus the measured wait for the slowest rank, which the planner leaves out."""
    row = planner_row(layout, m, world, calib, intra)
    assert row.compute_s is not None and row.comm_s is not None, row.problem
    comm = row.comm_s + calib["wait"]
    return row.compute_s + comm, comm


def _err(measured: float, predicted: float) -> str:
    if measured <= 0:
        return "-"
    e = (predicted - measured) / measured
    HITS.append(abs(e) <= TARGET)
    return f"{e:+.0%}" + ("" if abs(e) <= TARGET else " (miss)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per layout")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--save", type=Path, help="also write the raw measurements here (JSON)")
    parser.add_argument("--load", type=Path, help="print the tables of measurements saved by --save")
    args = parser.parse_args()
    started = time.monotonic()
    worlds = {}
    if args.load:
        saved = json.loads(args.load.read_text())
        worlds = {(w, n): saved[f"{w}x{n}"] for w, n in TOPOLOGIES}
    for workers, nodes in [] if args.load else TOPOLOGIES:
        layouts = {**BASE, **(EXTRA if (workers, nodes) == TOPOLOGIES[-1] else {})}
        worlds[workers, nodes] = run_world(workers, nodes, layouts, args)
        print(f"measured {workers} worker(s) on {nodes} node(s) ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    if args.save:
        args.save.write_text(json.dumps({f"{w}x{n}": world for (w, n), world in worlds.items()}))

    calibs = {}
    print("\n| world | matmul FLOP rate per rank | model MFU | all-reduce alpha | all-reduce bandwidth "
          "| wait for the slowest rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (workers, nodes), world in worlds.items():
        alpha, bw = fit_alpha_beta(world["sweep"], workers) if workers > 1 else (0.0, float("inf"))
        probe, params = world["probe"], world["layouts"]["ddp"]["params"]
        mfu = 6.0 * params * probe["tokens"] / (world["flops"] * probe["compute_s"])
        wait = probe["wait_s"] if workers > 1 else 0.0
        calibs[workers, nodes] = {"alpha": alpha, "bw": bw, "mfu": mfu, "wait": wait}
        bw_text = "-" if workers == 1 else f"{bw / 1e9:.2f} GB/s"
        alpha_text = "-" if workers == 1 else f"{alpha * 1e6:.0f} us"
        print(f"| {workers} x {nodes} | {world['flops'] / 1e9:.1f} GFLOP/s | {mfu:.0%} | {alpha_text} | {bw_text} "
              f"| {wait * 1e3:.1f} ms |")

    # A layout's own compute cost beyond the bare model's (FSDP2's copies and DTensor dispatch, DDP's
    # buckets and hook), per token, from the 1-worker run: the planner's one MFU for all layouts
    # would miss it (docs/planner.md, "Limits").
    solo, probe1 = worlds[1, 1]["layouts"], worlds[1, 1]["probe"]
    overhead = {name: (solo[name]["step_s"] - solo[name]["comm_s"]) / solo[name]["tokens_per_rank"]
                / (probe1["compute_s"] / probe1["tokens"]) for name in BASE}
    print("\n1-worker compute per token against the bare model's: "
          + ", ".join(f"{name} {x:.2f}x" for name, x in overhead.items()))

    print("\n| workers x nodes | layout | step measured | planner | error "
          "| comm share measured | planner | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (workers, nodes), world in worlds.items():
        for name, layout in BASE.items():
            m = world["layouts"][name]
            step_p, comm_p = planned(layout, m, world, with_overhead(calibs[workers, nodes], overhead[name]))
            share_m, share_p = m["comm_s"] / m["step_s"], comm_p / step_p
            if workers == 1:  # the baseline each layout's overhead is taken from
                print(f"| 1 x 1 | {name} | {m['step_s'] * 1e3:.0f} ms | {step_p * 1e3:.0f} ms | baseline "
                      f"| {share_m:.0%} | - | - |")
                continue
            print(f"| {workers} x {nodes} | {name} | {m['step_s'] * 1e3:.0f} ms | {step_p * 1e3:.0f} ms | "
                  f"{_err(m['step_s'], step_p)} | {share_m:.0%} | {share_p:.0%} | {_err(share_m, share_p)} |")

    print(f"\nwithin {TARGET:.0%} of the measurement: {sum(HITS)} of {len(HITS)} predictions (2 and 4 workers)")

    world = worlds[TOPOLOGIES[-1]]
    ddp_step = world["layouts"]["ddp"]["step_s"]
    print("\n| 4 workers x 2 nodes | bytes/step measured | predicted | step | vs ddp | comm share | planner |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, layout in {**BASE, **EXTRA}.items():
        m = world["layouts"][name]
        if "error" in m:
            print(f"| {name} | not run: {m['error']} | | | | | |")
            continue
        p = predict(layout, m, world, calibs[TOPOLOGIES[-1]])
        step_p, comm_p = planned(layout, m, world,
                                 with_overhead(calibs[TOPOLOGIES[-1]], overhead[LIKE.get(name, name)]))
        print(f"| {name} | {m['comm_bytes'] / 1e6:.2f} MB | {p['bytes'] / 1e6:.2f} MB | {m['step_s'] * 1e3:.0f} ms | "
              f"{m['step_s'] / ddp_step:.2f} | {m['comm_s'] / m['step_s']:.0%} | {comm_p / step_p:.0%} |")
    print(f"\n{time.monotonic() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
