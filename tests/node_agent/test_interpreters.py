"""Nothing a job supplies runs as root (issue 23, findings 1 and 2): which interpreters a job may
name (node_agent/confinement/interpreters.py, and at submit trainyard/protocol/interpreters.py), a whole part
with requirements whose every process is recorded by the kernel's proc connector (none but the
agent's own confine wrapper ever ran as uid 0: not the interpreter probe, not ``python -m venv``,
not pip, not torchrun), and a wheel that replaces the venv's interpreter, refused."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from node_agent.confinement import processes
from node_agent.confinement.interpreters import interpreter_problem
from node_agent.confinement.isolation import CONFINE_EXEC, Confinement, UidPool, UidRange, worker_paths
from node_agent.part.attempt import Part
from node_agent.part.commands import AttemptPaths, NodeContext
from node_agent.part.envs import EnvBuildFailed, EnvCache
from tests.helpers import make_wheel_with
from tests.node_agent.helpers import make_spec, read_log, wait_finished
from tests.node_agent.proc_events import ProcRecorder
from trainyard.protocol.agent import GpuInfo, NodeAttemptState
from trainyard.protocol.interpreters import python_path_problem

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids (and the proc connector) needs root")
UID = 20150 + 60  # the tests' corner of the dev pool (tests/node_agent/test_isolation.py), its own uids


def test_interpreters_in_places_anyone_can_write_are_refused_before_any_node() -> None:
    for path in ("/dev/shm/x/python", "/tmp/python", "/var/tmp/py", "/home/alice/.venv/bin/python", "/run/user/1/p",
                 "/opt/../tmp/python", "/usr/bin/./python3"):
        assert python_path_problem(path) is not None, path
    for path in ("/usr/bin/python3", "/opt/envs/llm/bin/python", "/root/.pyenv/versions/3.11.7/bin/python"):
        assert python_path_problem(path) is None, path
    assert "--allowed-python" in (python_path_problem("/dev/shm/x") or "")


@pytest.fixture
def trusted_dir() -> Iterator[Path]:
    """A root-owned directory outside the places anyone can write, to build interpreters' paths in."""
    base = Path(tempfile.mkdtemp(prefix="trainyard-interp-", dir="/run" if os.access("/run", os.W_OK) else "/var/lib"))
    try:
        base.chmod(0o755)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@root_only
def test_an_interpreter_is_allowed_when_root_owns_it_all_or_the_operator_listed_it(trusted_dir: Path) -> None:
    python = trusted_dir / "bin" / "python"
    python.parent.mkdir(mode=0o755)
    python.symlink_to(os.path.realpath(sys.executable))
    assert interpreter_problem(str(python)) is None  # root's, down to the interpreter it links to
    assert interpreter_problem(sys.executable) is None  # the agent's own

    python.parent.chmod(0o775)  # a group may replace the link now
    refused = interpreter_problem(str(python)) or ""
    assert f"{python.parent} is writable by its group" in refused and "--allowed-python" in refused
    assert interpreter_problem(str(python), allowed=[str(python)]) is None  # the operator vouches for it
    python.parent.chmod(0o755)

    planted = trusted_dir / "bin" / "planted"
    planted.write_text("#!/bin/sh\nexit 0\n")
    planted.chmod(0o755)
    os.chown(planted, UID, UID)  # a file of a worker uid's
    assert f"owned by uid {UID}" in (interpreter_problem(str(planted)) or "")
    os.chown(planted, 0, 0)
    planted.chmod(0o644)
    assert "not an executable" in (interpreter_problem(str(planted)) or "")
    assert "below /dev/shm" in (interpreter_problem("/dev/shm/python") or "")


# --- a whole part, every process recorded ---

TRAIN = """
import os, tinypkg
print("mark", tinypkg.MARK, "uid", os.getuid(), flush=True)
"""


@contextlib.contextmanager
def _lease(uid: int, locks: Path) -> Iterator[Confinement]:
    lease = UidPool(UidRange(uid, uid), locks).lease(processes.uids_alive)
    assert lease is not None, f"uid {uid} is in use"
    try:
        yield Confinement(uid=lease.uid, gid=lease.gid, lease=lease, expose=worker_paths(os.getcwd()))
    finally:
        lease.close()


@root_only
def test_no_process_of_a_job_with_requirements_runs_as_root(tmp_path: Path, open_dir: Path) -> None:
    """From the interpreter probe to the last worker, every program started for the part runs as its
    uid; uid 0 only ever runs the agent's own confine wrapper, which switches before anything else.
    The venv is then root's, read-only, and its requirements text is gone."""
    wheels = open_dir / "wheels"
    wheels.mkdir(mode=0o755)
    make_wheel_with(wheels, "tinypkg", "1.0", {"tinypkg.py": "MARK = 'one'\n"})
    (open_dir / "train.py").write_text(TRAIN)
    (open_dir / "train.py").chmod(0o644)
    spec = make_spec(nproc_per_node=1, gpu_indices=[0], entrypoint="train.py", python=sys.executable,
                     requirements=f"--no-index\n--find-links {wheels}\ntinypkg==1.0\n")
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, join_timeout_s=60,
                       shutdown_timeout_s=2, monitor_interval_s=0.2, cwd=str(open_dir))
    # The cache below a private directory (tmp_path is 0700): the build sees it in its own namespace.
    cache = EnvCache(tmp_path / "envs")
    paths = AttemptPaths(tmp_path / "attempt", open_dir / "worker")
    with _lease(UID, tmp_path / "locks") as confinement, ProcRecorder() as recorder:
        run = Part.launch(spec, node, paths, stop_grace_s=2.0, confinement=confinement, envs=cache)
        try:
            wait_finished(run, timeout=240)
        finally:
            run.kill_now()
    assert recorder.lost is None, recorder.lost
    assert run.exit_code == 0, (run.error, (paths.root / "torchrun.stderr.log").read_text()[-2000:])
    assert f"mark one uid {UID}" in read_log(run, 0)

    started = [e.cmdline for e in recorder.execs if e.uid != 0 and e.cmdline]
    said = [" ".join(c) for c in started]
    for what in ("import json, site, sys", "-m venv", "-m pip install", "node_agent.ranks.torchrun_entry", "train.py"):
        assert any(what in line for line in said), (what, said)  # seen: the probe, the venv, pip, torchrun
    assert {e.uid for e in recorder.execs} == {0, UID}
    assert recorder.root_execs_not_wrappers(CONFINE_EXEC) == []
    wrappers = [e for e in recorder.execs if e.uid == 0]
    assert len(wrappers) == 4  # the probe, the venv, pip, torchrun: each through the wrapper alone

    venv = Path(run.env_key and cache.root / run.env_key or "")
    for path in (venv, *venv.rglob("*")):
        info = path.lstat()
        if stat.S_ISLNK(info.st_mode):
            assert info.st_uid == 0, path
            continue
        assert info.st_uid == 0 and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH | stat.S_ISUID), path
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o711  # workers cannot list the venvs
    assert sorted(p.name for p in cache.root.iterdir()) == [".locks", venv.name]  # no requirements text left
    assert not list(venv.glob("*requirements*"))


@root_only
def test_a_wheel_that_replaces_the_venvs_interpreter_is_refused_and_never_runs(tmp_path: Path, open_dir: Path) -> None:
    """A wheel's ``<name>.data/scripts/python`` lands on the venv's bin/python: the build (as the
    part's uid) is refused, says why, leaves nothing, and the planted interpreter never ran."""
    wheels, ran = open_dir / "wheels", open_dir / "ran"
    wheels.mkdir(mode=0o755)
    ran.mkdir(mode=0o777)
    ran.chmod(0o1777)
    planted = f"#!/bin/sh\nid -u > {ran}/uid-$$\nexec {os.path.realpath(sys.executable)} \"$@\"\n"
    make_wheel_with(wheels, "evilpkg", "1.0", {"evilpkg.py": "X = 1\n", "evilpkg-1.0.data/scripts/python": planted,
                                      "evilpkg-1.0.data/scripts/python3": planted})
    cache = EnvCache(tmp_path / "envs")
    with (_lease(UID + 1, tmp_path / "locks") as confinement, ProcRecorder() as recorder,
          pytest.raises(EnvBuildFailed) as refused):
        cache.acquire(f"--no-index\n--find-links {wheels}\nevilpkg==1.0\n", sys.executable,
                      Confinement(uid=confinement.uid, gid=confinement.gid, expose=confinement.expose))
    assert recorder.lost is None, recorder.lost
    reason = str(refused.value)
    assert "replaced the venv's interpreter" in reason and "bin/python" in reason and "\n" not in reason, reason
    assert list(ran.iterdir()) == []  # the planted interpreter never ran, as anyone
    assert cache.cached() == [] and sorted(p.name for p in cache.root.iterdir()) == [".locks"]
    assert recorder.root_execs_not_wrappers(CONFINE_EXEC) == []
    assert any("-m pip install" in " ".join(e.cmdline or []) for e in recorder.execs if e.uid == UID + 1)


@root_only
def test_an_interpreter_this_node_does_not_allow_fails_the_part_at_once(tmp_path: Path, trusted_dir: Path) -> None:
    """A path that passed submit but not this node's rule: the part is reported exited with the rule
    that failed, as a start_error (the control plane fails the job without a retry:
    tests/control_plane/test_code_shipping.py), and the file never runs. Listed by the operator, it
    may run."""
    from node_agent.config import AgentConfig
    from node_agent.part.parts import Parts

    shared = trusted_dir / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace what is in it
    python = shared / "python"
    python.write_text(f"#!/bin/sh\ntouch {trusted_dir}/ran\nexec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    config = AgentConfig(control_plane_url="http://127.0.0.1:9", join_token="j", name="n", address="127.0.0.2",
                         virtual_gpus=1, work_dir=tmp_path / "agent", run_dir=tmp_path / "run")
    # Neither the workers' API nor the isolation is reached: the part is refused before either.
    launches = Parts(config, api=None, isolation=None, log=structlog.get_logger())  # type: ignore[arg-type]
    spec = make_spec(nproc_per_node=1, gpu_indices=[0], python=str(python))
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, cwd=str(tmp_path))
    run = launches.start(spec, node, [GpuInfo(index=0, uuid="virtual-n-0", kind="virtual-cpu", memory_mb=0)])
    assert run is not None
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and report.error_kind == "start_error", report
    assert f"{shared} is writable by others" in (report.error or "") and "--allowed-python" in (report.error or "")
    assert not (trusted_dir / "ran").exists()

    launches.config.allowed_pythons = (python,)
    assert launches.interpreter_refusal(spec) is None
