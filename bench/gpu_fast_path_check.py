"""The recovery fast paths on one GPU: a rank started in a warm standby, and a process group left
and joined again in the same process, with NCCL.

    python bench/gpu_fast_path_check.py [--device cpu] [--out FILE.json]   # cpu: gloo, a smoke run

The same probe (``PROBE`` below: a model of 8 x 2048^2 linear layers and AdamW, three DDP steps)
runs twice, in the same run:

- **cold**: through the rank shim as the agent's torchrun starts a rank, in a new interpreter;
- **warm**: through the same shim into a warm standby (node_agent/ranks/standby.py) started as the
  agent starts one: the standby's environment hides every GPU (``CUDA_VISIBLE_DEVICES=""``) and it
  imports ``standby_pool.PRELOAD`` without touching CUDA; the forked worker gets the rank's
  ``CUDA_VISIBLE_DEVICES`` and must see and initialise the GPU itself (CUDA cannot survive a fork,
  so the standby must never have initialised it: the script checks ``libcuda`` is not mapped in
  the standby after its imports).

In each, the probe then does what an in-process restart does (docs/architecture.md, "In-process
restart of healthy ranks"): it leaves its NCCL group with ``worker_runtime.distributed.abort_distributed``
(the communicators aborted), drops the DDP wrapper and empties the cache, and joins a new group on
a new store prefix, as the next attempt's fenced rendezvous does, then steps again. It reports, per
run: time to the first line, to torch imported, to the device ready, to the first group, the abort,
the second group; GPU memory with DDP, after the abort and after the second group; whether the
CUDA context was kept (the same context handle, and a tensor made before the abort still readable
without a new initialisation) and whether memory was released (DDP's buckets freed by the abort).

One GPU holds a world of one rank (NCCL refuses two ranks on one device): this checks the
mechanics (abort, CUDA context, memory, re-creation, a standby's CUDA after the fork), not a
collective across GPUs. Prints a table and, with ``--out``, the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from node_agent.ranks.standby_pool import PRELOAD  # noqa: E402

PROBE = r'''
import json, os, sys, time
first_line = time.time()
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from worker_runtime.distributed import abort_distributed
imported = time.time()
device = torch.device(sys.argv[1])
cuda = device.type == "cuda"
backend = "nccl" if cuda else "gloo"
out = {"first_line": first_line, "preloaded": "torch._dynamo" in sys.modules and "worker_runtime" in sys.modules,
       "parent": open(f"/proc/{os.getppid()}/cmdline").read().split("\0")[:3], "backend": backend}
def sync():
    if cuda:
        torch.cuda.synchronize()
def allocated():
    return torch.cuda.memory_allocated() if cuda else None
t = time.time()
if cuda:
    torch.cuda.set_device(0)
kept = torch.arange(1 << 20, dtype=torch.float32, device=device)
sync()
out["device_s"] = time.time() - t
context = torch.cuda.current_blas_handle() if cuda else None
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
def join(prefix):
    t = time.time()
    kwargs = {"device_id": device} if cuda else {}
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=0, world_size=1, **kwargs)
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    sync()
    return time.time() - t
model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
def steps(ddp):
    for _ in range(3):
        loss = ddp(torch.randn(64, 2048, device=device)).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    sync()
out["first_group_s"] = join("attempt-1/")
ddp = DDP(model, device_ids=[0] if cuda else None)
steps(ddp)
out["memory_with_ddp"] = allocated()
t = time.time()
del ddp
abort_distributed()
if cuda:
    torch.cuda.empty_cache()
out["abort_s"] = time.time() - t
out["group_gone"] = not dist.is_initialized()
out["memory_after_abort"] = allocated()
out["context_kept"] = (torch.cuda.current_blas_handle() == context) if cuda else True
out["tensor_kept"] = bool(kept[-1].item() == (1 << 20) - 1)
out["second_group_s"] = join("attempt-2/")
ddp = DDP(model, device_ids=[0] if cuda else None)
steps(ddp)
out["memory_after_second_group"] = allocated()
out["steps_after_restart"] = True
out["imported"], out["end"] = imported, time.time()
del ddp
dist.destroy_process_group()
print("PROBE " + json.dumps(out), flush=True)
'''


def _env(**extra: str) -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", **extra}


def _libcuda_mapped(pid: int) -> bool:
    try:
        return "/libcuda.so" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _run(work: Path, device: str, *, warm: bool) -> dict[str, Any]:
    name = "warm" if warm else "cold"
    run_dir = work / name
    run_dir.mkdir()
    probe = run_dir / "probe.py"
    probe.write_text(PROBE)
    visible = "0" if device == "cuda" else ""
    rank_env = _env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=visible,
                    TRAINYARD_STATUS_DIR=str(run_dir / "status"), TRAINYARD_JOB_ENV="{}")
    standby: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"run": name}
    try:
        if warm:
            standbys = run_dir / "standbys"
            standbys.mkdir()
            socket = standbys / "s.sock"
            command = [sys.executable, "-m", "node_agent.ranks.standby", "--socket", str(socket),
                       "--parent", str(os.getpid())]
            for module in PRELOAD:
                command += ["--preload", module]
            # As the agent starts one (node_agent/part/commands.py, standby_env): no GPU visible.
            standby = subprocess.Popen(command, env=_env(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES=""),
                                       start_new_session=True, stdout=subprocess.DEVNULL)
            deadline = time.monotonic() + 120
            while not socket.exists():
                if standby.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the standby did not listen (exit {standby.poll()})")
                time.sleep(0.05)
            result["standby_libcuda_mapped"] = _libcuda_mapped(standby.pid)
            rank_env["TRAINYARD_STANDBY_DIR"] = str(standbys)
        launched = time.time()
        shim = subprocess.run([sys.executable, "-m", "node_agent.ranks.shim", "--log-dir", str(run_dir / "logs"),
                               "file", str(probe), device], env=rank_env, cwd=run_dir, timeout=300)
        stdout = (run_dir / "logs" / "rank-0" / "stdout.log").read_text()
        stderr = (run_dir / "logs" / "rank-0" / "stderr.log").read_text()
        if shim.returncode != 0 or "PROBE " not in stdout:
            raise RuntimeError(f"{name} probe exited {shim.returncode}:\n{stderr[-3000:]}")
        probe_out = json.loads(stdout.split("PROBE ", 1)[1].splitlines()[0])
        record = json.loads((run_dir / "status" / "rank-0.json").read_text())
        result.update(probe_out)
        result["in_standby"] = bool(record.get("standby")) and "node_agent.ranks.standby" in probe_out["parent"]
        result["to_first_line_s"] = probe_out["first_line"] - launched
        result["to_imported_s"] = probe_out["imported"] - launched
        result["total_s"] = probe_out["end"] - launched
    finally:
        if standby is not None and standby.poll() is None:
            os.killpg(standby.pid, signal.SIGKILL)
            standby.wait(10)
    return result


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if value is None:
        return "-"
    return str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda":
        check = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                               capture_output=True, text=True, env=_env())
        if check.returncode != 0 or not check.stdout.strip().isdigit() or int(check.stdout) < 1:
            print("gpu_fast_path_check: no CUDA device here (use --device cpu for the smoke run)", file=sys.stderr)
            return 2
        name = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
                              capture_output=True, text=True, env=_env()).stdout.strip()
    else:
        name = "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu-fast-path-") as tmp:
        runs = [_run(Path(tmp), args.device, warm=False), _run(Path(tmp), args.device, warm=True)]
    keys = ("in_standby", "preloaded", "standby_libcuda_mapped", "to_first_line_s", "to_imported_s", "device_s",
            "first_group_s", "abort_s", "group_gone", "second_group_s", "memory_with_ddp", "memory_after_abort",
            "memory_after_second_group", "context_kept", "tensor_kept", "steps_after_restart", "total_s")
    print(f"device: {name} ({args.device}, backend {runs[0]['backend']})")
    print(f"| | {' | '.join(r['run'] for r in runs)} |")
    print(f"| --- | {' | '.join('---' for _ in runs)} |")
    for key in keys:
        print(f"| {key} | {' | '.join(_fmt(r.get(key)) for r in runs)} |")
    problems = []
    for r in runs:
        if not (r["group_gone"] and r["tensor_kept"] and r["context_kept"] and r["steps_after_restart"]):
            problems.append(f"{r['run']}: the group was not left and joined again with the context kept")
        if args.device == "cuda" and not (r["memory_after_abort"] < r["memory_with_ddp"]):
            problems.append(f"{r['run']}: no GPU memory released by the abort")
    if not runs[1]["in_standby"] or not runs[1]["preloaded"] or runs[1].get("standby_libcuda_mapped"):
        problems.append("warm: the rank did not run in a standby that never touched CUDA")
    for problem in problems:
        print(f"PROBLEM {problem}")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": name, "runs": runs, "problems": problems}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
