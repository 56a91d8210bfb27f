"""bench/gpu_fast_path_check.py's CPU path (issue 30): the script a GPU machine runs is ready and runs.

On CPU the probe uses gloo: a rank started cold and one in a warm standby each leave their process
group, keep their tensors, join a new group on a new store prefix and step again; the warm one ran
in a standby that had imported the platform's preloads. The CUDA figures need a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_the_gpu_fast_path_script_runs_its_cpu_path(tmp_path: Path) -> None:
    out = tmp_path / "fast-path.json"
    done = subprocess.run([sys.executable, "bench/gpu_fast_path_check.py", "--device", "cpu", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["problems"] == []
    cold, warm = result["runs"]
    assert (cold["run"], warm["run"]) == ("cold", "warm")
    assert warm["in_standby"] and warm["preloaded"] and not cold["in_standby"]
    for run in (cold, warm):
        assert run["group_gone"] and run["tensor_kept"] and run["steps_after_restart"] and run["backend"] == "gloo"
    assert "| second_group_s |" in done.stdout
