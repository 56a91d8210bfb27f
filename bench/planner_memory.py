"""The planner's memory and step-time prediction against real training steps on one GPU.

bench/planner_memory_gpu.py measures (torch with CUDA only, so it runs on a bare GPU machine:
peak ``torch.cuda.max_memory_allocated`` and step time of a GPT-style model under DDP and FSDP2,
with and without activation checkpointing); this script asks the planner about the same model and
prints both, side by side, with their ratio:

    python bench/planner_memory.py                      # on a CUDA machine: measure, then compare
    python bench/planner_memory.py ddp_0.json ...       # compare files planner_memory_gpu.py wrote
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.planning import (  # noqa: E402
    TransformerShape,
    Workload,
    bytes_per_param,
    estimate,
    resolve_hardware,
)
from trainyard.protocol.layout import Layout  # noqa: E402

GPU_SCRIPT = Path(__file__).with_name("planner_memory_gpu.py")


def measured_runs(paths: list[str]) -> list[dict]:
    if not paths:
        out = Path(tempfile.mkdtemp()) / "runs.json"
        subprocess.run([sys.executable, str(GPU_SCRIPT), str(out)], check=True)
        paths = [str(out)]
    runs = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        runs += [{**run, "shape": doc["shape"], "gpu": doc["gpu"], "torch": doc["torch"]} for run in doc["runs"]]
    return runs


def predict(run: dict) -> tuple[float, float, float]:
    """(peak bytes, its activations, step seconds at the default MFU) the planner gives for a run."""
    s = run["shape"]
    shape = TransformerShape(layers=s["layers"], hidden=s["hidden"], vocab=s["vocab"], heads=s["heads"])
    w = Workload(params=shape.params, bytes=bytes_per_param("bf16-mixed", "adamw"), seq_len=s["seq_len"],
                 global_batch=s["micro_batch"], micro_batch=s["micro_batch"], shape=shape,
                 activation_checkpointing=run["checkpointing"])
    row = estimate(w, resolve_hardware(run["gpu"], 1), Layout(kind=run["layout"]), 1)
    assert row.memory is not None and row.step_s is not None, row.problem
    return row.memory.total, row.memory.activations, row.step_s


def main() -> None:
    runs = measured_runs(sys.argv[1:])
    first = runs[0]
    s = first["shape"]
    print(f"{first['gpu']}, torch {first['torch']}: {s['layers']} layers x {s['hidden']}, vocab {s['vocab']}, "
          f"{s['seq_len']} tokens x {s['micro_batch']} samples, bf16 mixed precision, AdamW; one GPU\n")
    print("| layout | activation checkpointing | predicted peak | measured peak | predicted / measured "
          "| predicted step (MFU 0.4) | measured step | measured MFU |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in runs:
        peak, _, step = predict(run)
        tokens = s["seq_len"] * s["micro_batch"]
        mfu = 6 * run["params"] * tokens / run["step_s"] / resolve_hardware(run["gpu"], 1).peak_flops
        print(f"| {run['layout']} | {'yes' if run['checkpointing'] else 'no'} | {peak / 1e9:.1f} GB "
              f"| {run['peak_bytes'] / 1e9:.1f} GB | {peak / run['peak_bytes']:.2f} | {step:.3f} s "
              f"| {run['step_s']:.3f} s | {mfu:.2f} |")


if __name__ == "__main__":
    main()
