"""bench/exact_resume.py's CPU path (issue 24): the script the GPU machine runs is ready, and on CPU
its cases resume bit-exact from mid-epoch, epoch-boundary and mid-window points (two of its cases
here, to stay cheap; ``python -m bench.exact_resume --device cpu`` runs them all)."""

from __future__ import annotations

import pytest

from bench.exact_resume import main


def test_the_exact_resume_bench_runs_on_cpu_and_every_case_resumes_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--device", "cpu", "--steps", "10", "--resume-from", "3", "4", "--case", "dropout",
                 "--case", "accumulate"])
    assert [(row["case"], row["resume_from"]) for row in rows] == [
        ("dropout+batchnorm, SGD momentum", 3), ("dropout+batchnorm, SGD momentum", 4),
        ("accumulate 2 steps (cut mid-window)", 3), ("accumulate 2 steps (cut mid-window)", 4)]
    assert all(row["weights"] and row["losses"] for row in rows), rows
    printed = capsys.readouterr().out
    assert "device: CPU, torch" in printed and "| accumulate 2 steps (cut mid-window) | 3 | True | True |" in printed
