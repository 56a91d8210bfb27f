"""bench/start_limits.py runs (issue 23, finding 6's start-time figure): one round of a real confined
part with limits and one without, each to its first training step, and the JSON line the docs'
table is read from. It once broke silently when the part's TMPDIR moved (issue 24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(os.geteuid() != 0, reason="limits and worker uids need root (the bench refuses otherwise)")
def test_the_start_limits_bench_times_a_part_with_and_without_limits() -> None:
    done = subprocess.run([sys.executable, "bench/start_limits.py", "--repeat", "1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["repeat"] == 1 and set(figures["median_s"]) == {"limits", "none"}
    assert all(0 < seconds < 240 for seconds in figures["median_s"].values()), figures
    assert "ratio limits/none:" in done.stdout
