"""A job's shipped code and interpreter on a node (issue 13): the archive is fetched once per hash
into the work dir's cache and checked, unpacked into the attempt's worker directory (owned by the
attempt's uid), where the workers run and the entrypoint is found; the job's python runs torchrun
and the workers."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from node_agent.code import CodeUnavailable, cached_archive, unpack
from node_agent.isolation import make_worker_dir
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


def test_code_is_fetched_once_checked_and_run_in_the_worker_dir_with_the_jobs_python(launcher: Launcher,
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
    assert f"cwd {run.paths.worker / 'code'}" in out and "helper shipped" in out
    assert marker.read_text().count("used") >= 1
    assert os.access(run.paths.worker / "code" / "train.py", os.R_OK)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")
def test_code_unpacked_for_a_confined_attempt_is_its_uids_to_read(tmp_path: Path) -> None:
    """The code lands in the worker directory, which only the attempt's uid may enter (0700): the
    agent (root) unpacks it, and the workers, as that uid, must read it all."""
    uid = 20151  # the tests' corner of the dev pool (tests/node_agent/test_isolation.py)
    archive = tmp_path / "code.tar.gz"
    archive.write_bytes(_archive())
    # Where the uid can get to (a pytest tmp_path is 0700, as dev up's _workers_tmp works around).
    with tempfile.TemporaryDirectory() as base:
        Path(base).chmod(0o711)
        worker = Path(base) / "worker"
        make_worker_dir(worker, uid, uid)
        code = unpack(archive, worker / "code", uid=uid, gid=uid)
        for path in (code, code / "train.py", code / "data", code / "data" / "helper.txt"):
            assert path.stat().st_uid == uid and path.stat().st_gid == uid
        read = subprocess.run(["cat", str(code / "data" / "helper.txt")], user=uid, group=uid, extra_groups=[],
                              capture_output=True, text=True, timeout=10)
        assert (read.returncode, read.stdout) == (0, "shipped"), read.stderr
