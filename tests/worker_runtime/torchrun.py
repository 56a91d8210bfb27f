"""Run a module under ``torchrun --standalone`` with CPU ranks (two by default; for worker_runtime tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers import ProcessReaper

REPO = Path(__file__).resolve().parents[2]


def run_torchrun(reaper: ProcessReaper, module_args: list[str], extra_env: dict[str, str],
                 nproc: int = 2) -> tuple[Any, str]:
    """Rank 0's one JSON line on stdout (parsed), and the whole stdout; the run must succeed."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TRAINYARD_") and k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        **extra_env,
    )
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    args += ["-m", *module_args]
    proc = reaper.spawn(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{stdout}\n{stderr}"
    [line] = [line for line in stdout.splitlines() if line.startswith(("{", "["))]
    return json.loads(line), stdout
