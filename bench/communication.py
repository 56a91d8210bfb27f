"""Communication benchmark: measured step time and communication share of the runtime's layouts
against the textbook prediction, calibrated in the same run.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/communication.py [--steps 8]

1, 2 and 4 gloo workers (CPU) on 1 and 2 "nodes" (two torchrun instances on 127.0.0.1 and
127.0.0.2 with a static rendezvous, node rank 0 hosting it, as the node agent launches them), each
running bench/communication_worker.py: TinyGPT (d_model 256, 2 layers, 1.65 M parameters, 64
tokens per rank per micro-step) under ``worker_runtime.layouts.apply_layout``, measured by the
runtime's own meter (worker_runtime/comm_meter.py). Each world first calibrates itself: the FLOP
rate of a matmul of the model's MLP shape with every rank computing at once, and an all-reduce
sweep (4 KiB to 8 MiB) fitted to the alpha-beta model of a ring all-reduce.

The prediction (``predict`` below; the planner's textbook formulas):
- compute: 6 x parameters x tokens / (FLOP rate x MFU), the MFU taken from the 1-worker DDP run of
  this same invocation (the baseline: CPU efficiency on this model is far from the matmul's);
- communication: a ring all-reduce of B bytes on n ranks takes 2(n-1) alpha + 2(n-1)/n B / bw;
  an all-gather or a reduce-scatter (n-1) alpha + (n-1)/n B / bw. DDP all-reduces the gradients
  once per optimizer step (bf16/fp16: half the bytes; PowerSGD: rank x (rows + columns) per
  compressible matrix, the rest raw); FSDP all-gathers every block's parameters in forward and
  again in backward (the root's only once) and reduce-scatters the gradients; HSDP does that inside
  a node and all-reduces its shard of the gradients across nodes; accumulation divides nothing:
  one synchronisation per optimizer step (FSDP still all-gathers on every micro-step);
- no overlap: on 2 cores shared by up to 4 workers, gloo's threads compete with the compute for
  the same cores, and DDP's one large bucket is launched at the end of the backward anyway.

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

from trainyard.embedded import free_port  # noqa: E402

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
TARGET = 0.25


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TRAINYARD_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    return env


def run_world(workers: int, nodes: int, layouts: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """One world: a torchrun per node, static rendezvous on node rank 0; rank 0's JSON line."""
    port, per_node = free_port(), workers // nodes
    spec = json.dumps([{"name": name, "layout": layout} for name, layout in layouts.items()])
    procs = []
    try:
        for node_rank in range(nodes):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                   "--nproc-per-node", str(per_node), "--node-rank", str(node_rank), "--rdzv-backend", "static",
                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench-communication",
                   "--local-addr", f"127.0.0.{node_rank + 1}", "--max-restarts", "0",
                   str(ROOT / "bench" / "communication_worker.py"), "--layouts", spec,
                   "--steps", str(args.steps), "--warmup", str(args.warmup)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
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


def predict(layout: dict[str, Any], m: dict[str, Any], world: dict[str, Any],
            calib: dict[str, float]) -> dict[str, float]:
    """Bytes per rank per optimizer step (the collectives' payload), compute, communication and step seconds."""
    n, local = world["world_size"], world["local_world_size"]
    alpha, bw, mfu = calib["alpha"], calib["bw"], calib["mfu"]
    grad = 4.0 * m["params"]
    accum = layout.get("grad_accum_steps", 1)
    compute = 6.0 * m["params"] * m["tokens_per_rank"] / (world["flops"] * mfu)
    kind, compression = layout["kind"], layout.get("compression", "none")
    if kind == "ddp":
        payload = {"none": grad, "fp16": grad / 2, "bf16": grad / 2,
                   "powersgd": powersgd_bytes(m["shapes"])}[compression]
        buckets = math.ceil(grad / (layout.get("ddp_bucket_mb", 25.0) * 2**20))
        calls = buckets * (3 if compression == "powersgd" else 1)  # PowerSGD: P, Q and the raw tensors
        return {"bytes": payload, "compute": compute, "comm": all_reduce_s(payload, n, alpha, bw, calls)}
    blocks = [4.0 * u for u in m["unit_params"]]
    root = grad - sum(blocks)
    gathered = accum * (2 * sum(blocks) + root)  # every micro-step: forward and backward (the root once)
    gathers = accum * (2 * len(blocks) + 1)
    if kind == "fsdp":
        comm = gather_s(gathered, n, alpha, bw, gathers) + gather_s(grad, n, alpha, bw, len(blocks) + 1)
        return {"bytes": gathered + grad, "compute": compute, "comm": comm}
    shard = layout.get("shard_size") or local  # hsdp
    replicas = n // shard
    comm = (gather_s(gathered, shard, alpha, bw, gathers) + gather_s(grad, shard, alpha, bw, len(blocks) + 1)
            + all_reduce_s(grad / shard, replicas, alpha, bw, len(blocks) + 1))
    return {"bytes": gathered + grad + grad / shard, "compute": compute, "comm": comm}


# --- the tables --------------------------------------------------------------------------------


def _err(measured: float, predicted: float) -> str:
    if measured <= 0:
        return "-"
    e = (predicted - measured) / measured
    return f"{e:+.0%}" + ("" if abs(e) <= TARGET else " (miss)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per layout")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    started = time.monotonic()
    worlds = {}
    for workers, nodes in TOPOLOGIES:
        layouts = {**BASE, **(EXTRA if (workers, nodes) == TOPOLOGIES[-1] else {})}
        worlds[workers, nodes] = run_world(workers, nodes, layouts, args)
        print(f"measured {workers} worker(s) on {nodes} node(s) ({time.monotonic() - started:.0f} s)", file=sys.stderr)

    base = worlds[1, 1]["layouts"]["ddp"]
    base_compute = base["step_s"] - base["comm_s"]
    mfu = 6.0 * base["params"] * base["tokens_per_rank"] / (worlds[1, 1]["flops"] * base_compute)
    calibs = {}
    print("\n| world | matmul FLOP rate per rank | all-reduce alpha | all-reduce bandwidth |")
    print("| --- | --- | --- | --- |")
    for (workers, nodes), world in worlds.items():
        alpha, bw = fit_alpha_beta(world["sweep"], workers) if workers > 1 else (0.0, float("inf"))
        calibs[workers, nodes] = {"alpha": alpha, "bw": bw, "mfu": mfu}
        bw_text = "-" if workers == 1 else f"{bw / 1e9:.2f} GB/s"
        alpha_text = "-" if workers == 1 else f"{alpha * 1e6:.0f} us"
        print(f"| {workers} x {nodes} | {world['flops'] / 1e9:.1f} GFLOP/s | {alpha_text} | {bw_text} |")
    print(f"\nMFU of the 1-worker DDP baseline (6 N T / FLOP rate / measured compute): {mfu:.1%}")

    print("\n| workers x nodes | layout | step measured | predicted | error "
          "| comm share measured | predicted | error |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (workers, nodes), world in worlds.items():
        for name, layout in BASE.items():
            m = world["layouts"][name]
            p = predict(layout, m, world, calibs[workers, nodes])
            step_p = p["compute"] + p["comm"]
            share_m, share_p = m["comm_s"] / m["step_s"], p["comm"] / step_p
            share_err = _err(share_m, share_p) if workers > 1 else "-"
            print(f"| {workers} x {nodes} | {name} | {m['step_s'] * 1e3:.0f} ms | {step_p * 1e3:.0f} ms | "
                  f"{_err(m['step_s'], step_p)} | {share_m:.0%} | {share_p:.0%} | {share_err} |")

    world = worlds[TOPOLOGIES[-1]]
    ddp_step = world["layouts"]["ddp"]["step_s"]
    print("\n| 4 workers x 2 nodes | bytes/step measured | predicted | step | vs ddp | comm share | predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, layout in {**BASE, **EXTRA}.items():
        m = world["layouts"][name]
        if "error" in m:
            print(f"| {name} | not run: {m['error']} | | | | | |")
            continue
        p = predict(layout, m, world, calibs[TOPOLOGIES[-1]])
        print(f"| {name} | {m['comm_bytes'] / 1e6:.2f} MB | {p['bytes'] / 1e6:.2f} MB | {m['step_s'] * 1e3:.0f} ms | "
              f"{m['step_s'] / ddp_step:.2f} | {m['comm_s'] / m['step_s']:.0%} | "
              f"{p['comm'] / (p['compute'] + p['comm']):.0%} |")
    print(f"\n{time.monotonic() - started:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
