"""The worker runtime's CUDA path on one GPU: the layouts it applies (DDP, FSDP2, HSDP, accumulation,
compression) under bf16 autocast with NCCL, and the measured split (CUDA events) it reports.

tiny_gpt runs under ``torchrun --standalone --nproc-per-node 1`` with ``TRAINYARD_DEVICE=cuda`` and
each ``TRAINYARD_LAYOUT``, as an agent would start it (without an agent: no reports, no checkpoints).
Prints, per layout: ms per step, the communication share and bytes the runtime measured, peak GPU
memory, the final loss, and whether compute + communication = step (the meter's invariant).

    python bench/gpu_runtime_check.py [--device cpu] [--out FILE.json]   # cpu: a smoke run of this script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"kind": "ddp"},
    "ddp accum2 bf16-compress": {"kind": "ddp", "grad_accum_steps": 2, "compression": "bf16"},
    "fsdp": {"kind": "fsdp"},
    "hsdp": {"kind": "hsdp"},
}
STEP = re.compile(r"^step (\d+)/\d+ loss ([0-9.]+) .*\| ([0-9.]+) ms/step, (\d+)% communication")

# Prints the peak memory after the run: tiny_gpt's own main, then one line (rank 0 only).
PEAK = """
import json, sys, torch
from worker_runtime.examples import tiny_gpt
code = tiny_gpt.main(sys.argv[1:])
if torch.cuda.is_available():
    print("PEAK " + json.dumps({"max_allocated": torch.cuda.max_memory_allocated()}), flush=True)
sys.exit(code)
"""


def run(name: str, layout: dict, device: str, model_args: list[str], steps: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env.update(TRAINYARD_DEVICE=device, TRAINYARD_LAYOUT=json.dumps(layout), OMP_NUM_THREADS="4",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    script = REPO / ".gpu_check_main.py"
    script.write_text(PEAK)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", str(script),
            "--steps", str(steps), "--log-every", str(max(1, steps // 4)), "--bf16", *model_args]
    t0 = time.monotonic()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    wall = time.monotonic() - t0
    out = proc.stdout
    steps_seen = [STEP.match(line) for line in out.splitlines()]
    lines = [m for m in steps_seen if m]
    result = next((json.loads(line) for line in out.splitlines() if line.startswith("{")), None)
    peak: dict[str, Any] = next((json.loads(line[5:]) for line in out.splitlines() if line.startswith("PEAK ")), {})
    last = lines[-1] if lines else None
    return {
        "layout": name, "rc": proc.returncode, "wall_s": round(wall, 1),
        "ms_per_step": float(last.group(3)) if last else None,
        "comm_share": int(last.group(4)) / 100 if last else None,
        "final_loss": result.get("final_loss") if result else None,
        "metrics": (result or {}).get("metrics"),
        "peak_bytes": peak.get("max_allocated"),
        "stderr_tail": proc.stderr[-1500:] if proc.returncode else "",
        "stdout_tail": out[-800:],
    }


def predicted(rows: list[dict], model: list[str]) -> None:
    """The planner's peak memory for tiny_gpt's shape on this GPU, next to the measured peak."""
    import torch

    sys.path.insert(0, str(REPO))
    from control_plane.planning import TransformerShape, Workload, bytes_per_param, estimate, resolve_hardware
    from trainyard.protocol.layout import Layout
    from worker_runtime.examples.tiny_gpt import TinyGPT

    arg = {model[i][2:].replace("-", "_"): int(model[i + 1]) for i in range(0, len(model), 2)}
    with torch.device("meta"):
        params = sum(p.numel() for p in TinyGPT(arg["vocab"], arg["seq_len"], arg["d_model"], arg["layers"],
                                                arg["heads"]).parameters())
    shape = TransformerShape(layers=arg["layers"], hidden=arg["d_model"], vocab=arg["vocab"], heads=arg["heads"])
    gpu = torch.cuda.get_device_name()
    print(f"\nplanner vs measured peak ({gpu}, {params / 1e6:.0f}M parameters, fp32 weights, bf16 autocast)")
    for r in rows:
        layout = LAYOUTS[r["layout"]]
        w = Workload(params=params, bytes=bytes_per_param("bf16-mixed", "adamw"), seq_len=arg["seq_len"],
                     global_batch=arg["batch_size"], micro_batch=arg["batch_size"] // layout.get("grad_accum_steps", 1),
                     shape=shape)
        row = estimate(w, resolve_hardware(gpu, 1), Layout(**layout), 1)
        got = r["peak_bytes"]
        if row.memory is None or not got:
            print(f"{r['layout']:<26} predicted {row.memory and row.memory.total} measured {got}")
            continue
        r["predicted_peak_bytes"] = row.memory.total
        print(f"{r['layout']:<26} predicted {row.memory.total / 2**30:6.2f} GiB  measured {got / 2**30:6.2f} GiB"
              f"  ratio {row.memory.total / got:.2f}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    if a.device == "cuda":
        model = ["--d-model", "2048", "--layers", "16", "--heads", "16", "--vocab", "16384", "--seq-len", "512",
                 "--batch-size", "8"]
    else:
        model = ["--steps", "8"]
    rows = []
    for name, layout in LAYOUTS.items():
        row = run(name, layout, a.device, model, a.steps if a.device == "cuda" else 8)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("stdout_tail",)}), flush=True)
    print()
    print(f"{'layout':<26} {'rc':>3} {'ms/step':>8} {'comm':>6} {'peak GiB':>9} {'final loss':>10}")
    for r in rows:
        peak = f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else "-"
        print(f"{r['layout']:<26} {r['rc']:>3} {r['ms_per_step'] or '-':>8} "
              f"{'-' if r['comm_share'] is None else format(r['comm_share'], '.0%'):>6} {peak:>9} "
              f"{r['final_loss'] if r['final_loss'] is not None else '-':>10}")
    if a.device == "cuda":
        predicted(rows, model)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
