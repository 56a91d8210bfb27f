"""A job's shipped code on a node (issue 13; issue 23, findings 3 and 4): the archive is fetched once
per hash into the work dir's cache (root's alone) and checked, unpacked in the part's own thread, as
the attempt's uid, within caps on bytes, entries and time, into the attempt's worker directory
(owned by that uid, closed to every other), where the workers run and the entrypoint is found; the
job's python runs torchrun and the workers."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

import pytest

from node_agent.confinement.isolation import Confinement, make_worker_dir, worker_paths
from node_agent.part.attempt import Part, attempt_paths
from node_agent.part.code import CodeLimits, CodeUnavailable, ShippedCode, cached_archive, unpack
from tests.node_agent.helpers import Launcher, local_code, make_spec, read_log, wait_finished, wait_for
from trainyard.protocol.agent import CodeRef

TRAIN = "import os, sys\nprint('cwd', os.getcwd())\nprint('helper', open('data/helper.txt').read())\n"
UID, OTHER_UID = 20151, 20152  # the tests' corner of the dev pool (tests/node_agent/test_isolation.py)
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")


def _archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, text in (("train.py", TRAIN), ("data/helper.txt", "shipped")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return raw.getvalue()


def _zeros(files: int, mib: int) -> bytes:
    """A zero bomb: ``files`` files of ``mib`` MiB of zeros each, a few hundred KiB packed."""
    raw, zeros = io.BytesIO(), io.BytesIO(bytes(mib << 20))
    with tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1) as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"zeros-{i}")
            info.size = mib << 20
            zeros.seek(0)
            tar.addfile(info, zeros)
    return raw.getvalue()


def _empty_files(n: int) -> bytes:
    """An archive of ``n`` empty files (ustar headers written directly: tarfile takes seconds)."""
    head = bytearray(tarfile.TarInfo("f0000000").tobuf(format=tarfile.USTAR_FORMAT))
    head[148:156] = b" " * 8  # the checksum counts its own field as spaces
    base = sum(head) - sum(b"f0000000")
    blocks = []
    for i in range(n):
        name = b"f%07d" % i
        block = bytearray(head)
        block[0:8] = name
        block[148:156] = b"%06o\0 " % (base + sum(name))
        blocks.append(bytes(block))
    return gzip.compress(b"".join(blocks) + bytes(1024), compresslevel=1)


def _fetch_of(data: bytes, calls: list[int] | None = None):  # type: ignore[no-untyped-def]
    def fetch(out: BinaryIO, max_bytes: int, deadline: float) -> None:
        if calls is not None:
            calls.append(max_bytes)
        out.write(data)

    return fetch


def _ref(data: bytes) -> CodeRef:
    return CodeRef(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))


def _tree_bytes(path: Path) -> tuple[int, int]:
    """(bytes, entries) below ``path``."""
    total = entries = 0
    for root, dirs, files in os.walk(path):
        entries += len(dirs) + len(files)
        total += sum(os.lstat(os.path.join(root, f)).st_size for f in files)
    return total, entries


def test_code_is_fetched_once_checked_and_run_in_the_worker_dir_with_the_jobs_python(launcher: Launcher,
                                                                                      tmp_path: Path) -> None:
    data = _archive()
    ref = _ref(data)
    fetched: list[int] = []
    work = tmp_path / "work"
    archive = cached_archive(work, ref, _fetch_of(data, fetched))
    assert cached_archive(work, ref, _fetch_of(data, fetched)) == archive
    assert fetched == [len(data)]  # once per hash, and no more bytes than the control plane named
    with pytest.raises(CodeUnavailable, match="sha256"):
        cached_archive(work, CodeRef(sha256="0" * 64, size_bytes=len(data)), _fetch_of(data))
    assert sorted(p.name for p in (work / "code").iterdir()) == [archive.name]  # nothing half-written left

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


def test_the_cache_is_roots_alone_and_an_archive_over_the_cap_is_never_fetched(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "code").mkdir(parents=True, mode=0o755)  # as an earlier agent left it
    data = _archive()
    stale = work / "code" / f"{_ref(data).sha256}.tar.gz"
    stale.write_bytes(data)
    stale.chmod(0o644)
    archive = cached_archive(work, _ref(data), _fetch_of(b"never fetched"))
    assert archive == stale
    assert stat.S_IMODE((work / "code").stat().st_mode) == 0o700
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    fetched: list[int] = []
    big = CodeRef(sha256="1" * 64, size_bytes=2 << 20)
    with pytest.raises(CodeUnavailable, match="over this node's 1048576") as refused:
        cached_archive(work, big, _fetch_of(b"", fetched), CodeLimits(max_bytes=1 << 20))
    assert refused.value.permanent and fetched == []


@root_only
def test_code_is_unpacked_as_the_attempts_uid_and_no_other_uid_reaches_it_or_the_cache() -> None:
    """The agent (root) never parses the archive: the attempt's uid unpacks it, from a file root
    opened in its private cache, into the worker directory only that uid may enter; another
    worker uid can neither list the cache, read the archive, nor reach the unpacked code."""
    # Where the uids can get to (a pytest tmp_path is 0700, as dev up's _workers_tmp works around):
    # what stops them below is the cache's and the worker directory's own modes.
    with tempfile.TemporaryDirectory() as base:
        Path(base).chmod(0o711)
        archive = cached_archive(Path(base) / "work", _ref(_archive()), _fetch_of(_archive()))
        Path(base, "work").chmod(0o711)
        worker = Path(base) / "worker"
        make_worker_dir(worker, UID, UID)
        confinement = Confinement(uid=UID, gid=UID, expose=worker_paths(os.getcwd()))  # as the agent confines
        code = unpack(archive, worker / "code", confinement=confinement)
        for path in (code, code / "train.py", code / "data", code / "data" / "helper.txt"):
            assert path.stat().st_uid == UID and path.stat().st_gid == UID
        assert stat.S_IMODE(code.stat().st_mode) == 0o700

        def as_uid(uid: int, *command: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(command, user=uid, group=uid, extra_groups=[], capture_output=True, text=True,
                                  timeout=10)

        read = as_uid(UID, "cat", str(code / "data" / "helper.txt"))
        assert (read.returncode, read.stdout) == (0, "shipped"), read.stderr
        for command in (("ls", str(archive.parent)), ("cat", str(archive)), ("ls", str(code)),
                        ("cat", str(code / "train.py"))):
            denied = as_uid(OTHER_UID, *command)
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, (command, denied)
        # Not even the attempt's own uid reads the cache: root hands it the open archive.
        assert as_uid(UID, "cat", str(archive)).returncode != 0


def test_a_zero_bomb_stops_at_the_byte_cap_with_nothing_past_it_written(tmp_path: Path) -> None:
    archive = tmp_path / "bomb.tar.gz"
    archive.write_bytes(_zeros(files=3, mib=30))  # 90 MiB of zeros in about 100 KiB
    assert archive.stat().st_size < 1 << 20
    with pytest.raises(CodeUnavailable, match=r"unpacks to more than 64\.0 MiB .*'zeros-2' brings it to 90\.0 MiB") \
            as refused:
        unpack(archive, tmp_path / "code", limits=CodeLimits(max_bytes=64 << 20))
    assert refused.value.permanent  # the job's own archive: no other attempt would do better
    written, _ = _tree_bytes(tmp_path / "code")
    assert written <= 64 << 20

    # A header that declares more than the cap is refused before a byte of it is read.
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("declared")
        info.size = 5 << 30
        tar.addfile(info)  # a header without the 5 GiB it announces: the cap stops first
    declared = tmp_path / "declared.tar.gz"
    declared.write_bytes(gzip.compress(raw.getvalue()))
    with pytest.raises(CodeUnavailable, match=r"unpacks to more than 4\.0 GiB"):
        unpack(declared, tmp_path / "code-2")
    assert _tree_bytes(tmp_path / "code-2") == (0, 0)


def test_an_archive_of_200k_empty_files_stops_at_the_entry_cap(tmp_path: Path) -> None:
    archive = tmp_path / "many.tar.gz"
    archive.write_bytes(_empty_files(200_000))
    with pytest.raises(CodeUnavailable, match="holds more than 2000 entries") as refused:
        unpack(archive, tmp_path / "code", limits=CodeLimits(max_entries=2000))
    assert refused.value.permanent
    assert _tree_bytes(tmp_path / "code") == (0, 2000)


def test_an_unpacking_that_outlasts_the_time_cap_is_killed(tmp_path: Path) -> None:
    """An archive whose bytes trickle (here a FIFO that is written once, then never again): the
    unpacking is killed at the cap and the attempt is told why."""
    fifo = tmp_path / "slow.tar.gz"
    os.mkfifo(fifo)
    first = gzip.compress(tarfile.TarInfo("a").tobuf(format=tarfile.USTAR_FORMAT))[:20]
    writer_done = threading.Event()

    def trickle() -> None:
        try:
            with open(fifo, "wb") as out:
                out.write(first)
                out.flush()
                writer_done.wait(30)  # held open: the reader waits for more
        except BrokenPipeError:
            pass

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    started = time.monotonic()
    try:
        with pytest.raises(CodeUnavailable, match=r"took more than 1 s to unpack") as refused:
            unpack(fifo, tmp_path / "code", limits=CodeLimits(timeout_s=1.0))
    finally:
        writer_done.set()
        thread.join(10)
    assert refused.value.permanent
    assert 1.0 <= time.monotonic() - started < 15


def test_an_attempt_whose_code_is_over_a_cap_fails_with_the_reason_as_a_start_error(launcher: Launcher,
                                                                                    tmp_path: Path) -> None:
    archive = tmp_path / "many.tar.gz"
    archive.write_bytes(_empty_files(3000))
    spec = make_spec(entrypoint="train.py", nproc_per_node=1, gpu_indices=[0], code=_ref(archive.read_bytes()))
    node = launcher.node()
    paths = attempt_paths(tmp_path / "node", spec.attempt_id)
    run = Part.launch(spec, node, paths, stop_grace_s=2.0,
                            code=local_code(archive, tmp_path / "cache", CodeLimits(max_entries=1000)))
    launcher.runs.append(run)
    wait_finished(run, timeout=60)
    assert run.error is not None and "holds more than 1000 entries" in run.error
    assert run.error_kind == "start_error" and run.pid is None


class _Fifo(ShippedCode):
    """Code whose archive is a FIFO nothing writes to: its unpacking waits for ever."""

    def archive(self) -> Path:
        return self.work_dir / "never.tar.gz"


def test_a_part_stopped_while_its_code_unpacks_kills_the_unpacking(launcher: Launcher, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "never.tar.gz")
    held = os.open(tmp_path / "never.tar.gz", os.O_RDWR)  # a writer that never writes: no EOF either
    try:
        spec = make_spec(entrypoint="train.py", nproc_per_node=1, gpu_indices=[0], code=_ref(b"x"))
        code = _Fifo(spec.code, tmp_path, _fetch_of(b""), CodeLimits(timeout_s=120))  # type: ignore[arg-type]
        run = Part.launch(spec, launcher.node(), attempt_paths(tmp_path / "node", spec.attempt_id),
                                stop_grace_s=2.0, code=code)
        launcher.runs.append(run)
        proc = wait_for(lambda: run._unpacking, timeout=30, interval=0.05, what="the unpacking to start")
        assert run.preparing and run.alive
        run.request_stop("no longer assigned")
        assert proc.poll() is not None  # killed, not left to run out its 120 s
        assert not run.alive and run.stopped and run.error is None
    finally:
        os.close(held)
