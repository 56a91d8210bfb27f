"""A job's shipped code and interpreter on a node (issue 13): the archive is fetched once per hash
into the work dir's cache and checked, unpacked into the attempt's directory, where the workers
run and the entrypoint is found; the job's python runs torchrun and the workers."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tarfile
from pathlib import Path

import pytest

from node_agent.code import CodeUnavailable, cached_archive
from tests.node_agent.helpers import Launcher, make_spec, read_log, wait_finished
from trainyard.protocol.agent import CodeRef

TRAIN = "import os, sys\nprint('cwd', os.getcwd())\nprint('helper', open('data/helper.txt').read())\n"


def _archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, text in (("train.py", TRAIN), ("data/helper.txt", "shipped")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return raw.getvalue()


def test_code_is_fetched_once_checked_and_run_in_the_attempts_dir_with_the_jobs_python(launcher: Launcher,
                                                                                      tmp_path: Path) -> None:
    data = _archive()
    ref = CodeRef(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    fetched: list[int] = []

    def fetch() -> bytes:
        fetched.append(1)
        return data

    work = tmp_path / "work"
    archive = cached_archive(work, ref, fetch)
    assert cached_archive(work, ref, fetch) == archive and fetched == [1]  # once per hash
    with pytest.raises(CodeUnavailable, match="sha256"):
        cached_archive(work, CodeRef(sha256="0" * 64, size_bytes=1), lambda: data)

    marker = tmp_path / "python-used"
    python = tmp_path / "python"  # the job's interpreter: a wrapper that leaves a mark
    python.write_text(f"#!/bin/sh\necho used >> {marker}\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    spec = make_spec(entrypoint="train.py", nproc_per_node=1, gpu_indices=[0], code=ref, python=str(python))
    run = launcher.launch_with_code(spec, archive)
    wait_finished(run, timeout=60)
    assert run.exit_code == 0, read_log(run, 0, "stderr")
    out = read_log(run, 0)
    assert f"cwd {run.paths.root / 'code'}" in out and "helper shipped" in out
    assert marker.read_text().count("used") >= 1
    assert os.access(run.paths.root / "code" / "train.py", os.R_OK)
