"""What a venv's build may do as the part's uid, and what root then does with it (issue 23 review,
findings 1, 2, 3 and 5b; node_agent/part/envs.py, venv_checks.py, attempt.py).

The build's own code is played by an interpreter the operator could have installed (root-owned, in
a root-owned directory): a shell wrapper around the node's Python that, as the part's uid, does what
a package's build code could (plant a link, leave a daemon, block), or records its environment.
Every test runs real processes as a pool uid, as root, and kills what it started."""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import stat
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from node_agent.confinement import processes
from node_agent.confinement.cgroups import CgroupTree
from node_agent.confinement.isolation import Confinement, UidPool, UidRange, worker_paths
from node_agent.confinement.safe_files import create_file
from node_agent.part.attempt import Part
from node_agent.part.commands import AttemptPaths, NodeContext
from node_agent.part.envs import EnvBuildFailed, EnvCache, end_build
from node_agent.part.venv_checks import VenvTampered, seal
from tests.helpers import make_wheel_with, wait_for
from tests.node_agent.helpers import make_spec
from tests.node_agent.proc_events import ProcRecorder
from trainyard.protocol.agent import GpuInfo, NodeAttemptState

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids (and the proc connector) needs root")
UID = 20150 + 80  # the tests' corner of the dev pool (tests/node_agent/test_isolation.py), its own uids
REAL = os.path.realpath(sys.executable)
WRAPPER = """#!/bin/sh
# As the build's uid: what a package's build code could do.
env > {out}/env-$$
for last; do :; done
case " $* " in
  *" -m venv "*)
    "{real}" "$@" || exit $?
    {on_venv}
    exit 0 ;;
esac
exec "{real}" "$@"
"""


@pytest.fixture
def place() -> Iterator[Path]:
    """A root-owned directory (0755) outside the places anyone can write: the wrapper lives in
    ``bin``, and ``out`` (1777) is where the build's uid leaves what it saw."""
    base = Path(tempfile.mkdtemp(prefix="trainyard-venvb-", dir="/run" if os.access("/run", os.W_OK) else "/var/lib"))
    try:
        base.chmod(0o755)
        (base / "bin").mkdir(mode=0o755)
        (base / "out").mkdir()
        (base / "out").chmod(0o1777)
        (base / "wheels").mkdir(mode=0o755)
        make_wheel_with(base / "wheels", "tinypkg", "1.0", {"tinypkg.py": "MARK = 'one'\n"})
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wrapper(place: Path, on_venv: str = ":") -> str:
    python = place / "bin" / "python"
    python.write_text(WRAPPER.format(out=place / "out", real=REAL, on_venv=on_venv))
    python.chmod(0o755)
    return str(python)


def _requirements(place: Path) -> str:
    return f"--no-index\n--find-links {place / 'wheels'}\ntinypkg==1.0\n"


@contextlib.contextmanager
def _leased(uid: int, locks: Path, cgroup: bool = False) -> Iterator[Confinement]:
    """The uid leased as a part's, in a cgroup of its own when asked; every process of both killed
    at the end, whatever the test did."""
    lease = UidPool(UidRange(uid, uid), locks).lease(processes.uids_alive)
    assert lease is not None, f"uid {uid} is in use"
    confinement = Confinement(uid=lease.uid, gid=lease.gid, lease=lease, expose=worker_paths(os.getcwd()))
    if cgroup:
        tree, why = CgroupTree.detect()
        assert tree is not None, why  # this machine (and CI) have a writable cgroup v2
        confinement.cgroup = tree.for_part("test-node", f"venvb-{os.getpid()}-{uid}", 0)
        confinement.cgroup.create()
    try:
        yield confinement
    finally:
        assert end_build(confinement) == []
        if confinement.cgroup is not None:
            confinement.cgroup.remove()
        lease.close()


def _builder(confinement: Confinement) -> Confinement:
    """As attempt.py's _builder makes it: the part's uid and cgroup, seeing the node's installation."""
    return Confinement(uid=confinement.uid, gid=confinement.gid, cgroup=confinement.cgroup,
                       expose=worker_paths(os.getcwd()))


# --- finding 1: root never writes through what the build left ---

@root_only
def test_a_link_the_build_plants_as_the_marker_is_refused_and_never_written_through(
        tmp_path: Path, place: Path) -> None:
    """Build code (as the uid) makes the venv's trainyard-env.json a link to a root file: the venv
    is refused, says why, and the file is untouched (content and mode): root created nothing through
    the link, chmod'ed nothing."""
    victim = place / "victim"
    victim.write_text("root's own\n")
    victim.chmod(0o600)
    python = _wrapper(place, f'ln -s {victim} "$last/trainyard-env.json"')
    cache = EnvCache(tmp_path / "envs")
    with _leased(UID, tmp_path / "locks") as confinement, pytest.raises(EnvBuildFailed) as refused:
        cache.acquire(_requirements(place), python, _builder(confinement))
    assert "trainyard-env.json" in str(refused.value) and "link" in str(refused.value), refused.value
    assert victim.read_text() == "root's own\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert cache.cached() == [] and sorted(p.name for p in cache.root.iterdir()) == [".locks"]


def test_seal_keeps_only_the_links_python_m_venv_makes(tmp_path: Path) -> None:
    """bin/python* and lib64 -> lib pass; any other link (into site-packages, to /etc) is refused
    before anything is changed through it; a marker is created, never opened when a name is there."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    (venv / "bin" / "python").symlink_to(REAL)
    (venv / "bin" / "python3").symlink_to("python")
    (venv / "lib64").symlink_to("lib")
    (site / "mod.py").write_text("X = 1\n")
    assert seal(venv, owner=None) > 0
    assert stat.S_IMODE((site / "mod.py").stat().st_mode) == 0o644

    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o600)
    (site / "evil").symlink_to(outside)
    with pytest.raises(VenvTampered, match="site-packages/evil"):
        seal(venv, owner=None)
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600
    (site / "evil").unlink()
    (venv / "bin" / "tool").symlink_to(REAL)
    with pytest.raises(VenvTampered, match="bin/tool"):
        seal(venv, owner=None)

    (venv / "trainyard-env.json").symlink_to(tmp_path / "nowhere")  # dangling: O_CREAT alone would make it
    with pytest.raises(FileExistsError):
        create_file(venv, "trainyard-env.json", data=b"{}", mode=0o644)
    assert not (tmp_path / "nowhere").exists()


@root_only
def test_requirements_that_pip_would_build_from_source_fail_the_part_at_once(tmp_path: Path) -> None:
    """A spec from elsewhere than the control plane (which answers 422): the agent refuses the line
    as a start_error (never retried) and runs nothing for it."""
    from node_agent.config import AgentConfig
    from node_agent.part.parts import Parts

    config = AgentConfig(control_plane_url="http://127.0.0.1:9", join_token="j", name="n", address="127.0.0.2",
                         virtual_gpus=1, work_dir=tmp_path / "agent", run_dir=tmp_path / "run")
    # Neither the workers' API nor the isolation is reached: the part is refused before either.
    launches = Parts(config, api=None, isolation=None, log=structlog.get_logger())  # type: ignore[arg-type]
    spec = make_spec(nproc_per_node=1, gpu_indices=[0], requirements="evilpkg @ file:///etc/passwd\n")
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, cwd=str(tmp_path))
    run = launches.start(spec, node, [GpuInfo(index=0, uuid="virtual-n-0", kind="virtual-cpu", memory_mb=0)])
    assert run is not None
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and report.error_kind == "start_error", report
    assert "never a URL, a path or 'name @ url'" in (report.error or ""), report.error
    assert not (tmp_path / "agent" / "envs").exists() or not any((tmp_path / "agent" / "envs").iterdir())


# --- finding 2: nothing of the build outlives it; the uid is kept until it has returned ---

@root_only
def test_a_daemon_the_build_leaves_is_killed_before_the_venv_is_sealed(tmp_path: Path, place: Path) -> None:
    """Build code double-forks a daemon into a session of its own; the build still succeeds, and
    when acquire returns no process of the uid is left, nor any in the part's cgroup."""
    python = _wrapper(place, "( setsid sleep 300 </dev/null >/dev/null 2>&1 & )")
    cache = EnvCache(tmp_path / "envs")
    with _leased(UID + 1, tmp_path / "locks", cgroup=True) as confinement:
        key, venv_python = cache.acquire(_requirements(place), python, _builder(confinement))
        assert UID + 1 not in processes.uids_alive()
        assert confinement.cgroup is not None and confinement.cgroup.pids() == set()
    assert Path(venv_python).parent.parent.name == key and cache.cached()


@root_only
def test_a_part_stopped_during_its_build_keeps_its_uid_until_the_build_is_over(tmp_path: Path, place: Path) -> None:
    """Stopped while its build runs (as its uid), the part is finished (its uid free to be given
    back) only once no process of that uid is left: its build is killed, and nothing is sealed."""
    python = _wrapper(place, f"touch {place}/out/started; sleep 300")
    spec = make_spec(nproc_per_node=1, gpu_indices=[0], python=python, requirements=_requirements(place))
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, cwd=str(place))
    cache = EnvCache(tmp_path / "envs")
    worker = Path(tempfile.mkdtemp(prefix="venvb-worker-", dir="/tmp"))
    try:
        with _leased(UID + 2, tmp_path / "locks") as confinement:
            run = Part.launch(spec, node, AttemptPaths(tmp_path / "attempt", worker / "w"), stop_grace_s=2.0,
                                    confinement=confinement, envs=cache)
            wait_for(lambda: (place / "out" / "started").exists(), 60, what="the build to run")
            run.request_stop("cancelled")
            wait_for(lambda: run.finished, 30, what="the part to finish")
            assert UID + 2 not in processes.uids_alive()  # at the moment it may be given back
            assert run.report(None, None).state == NodeAttemptState.stopped and run.pid is None
            assert cache.cached() == [] and not cache.in_use()
    finally:
        shutil.rmtree(worker, ignore_errors=True)


# --- finding 3: the build sees an allow-list of the agent's environment ---

@root_only
def test_the_probe_venv_and_pip_see_none_of_the_agents_secrets(tmp_path: Path, place: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Canaries in the agent's environment (its join token, a cloud credential) reach none of the
    build's processes (the probe and the venv, recorded by the wrapper; pip, read by the proc
    connector); the operator's PIP_* settings and PATH do."""
    monkeypatch.setenv("TRAINYARD_JOIN_TOKEN", "canary-join-token")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary-aws-secret")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "37")
    python = _wrapper(place)
    cache = EnvCache(tmp_path / "envs")
    with _leased(UID + 3, tmp_path / "locks") as confinement, ProcRecorder() as recorder:
        cache.acquire(_requirements(place), python, _builder(confinement))
    assert recorder.lost is None, recorder.lost
    seen = [p.read_text() for p in (place / "out").glob("env-*")]
    assert len(seen) >= 2  # the probe and python -m venv
    pip = [e.environ for e in recorder.execs if e.uid == UID + 3 and "-m pip install" in " ".join(e.cmdline or [])]
    assert pip and pip[0] is not None, recorder.execs
    seen += ["\n".join(f"{k}={v}" for k, v in env.items()) for env in pip if env is not None]
    for text in seen:
        assert "canary" not in text and "TRAINYARD_" not in text, text
        assert "PATH=" in text
    assert pip[0] is not None and pip[0].get("PIP_DEFAULT_TIMEOUT") == "37" and pip[0].get("PIP_NO_INPUT") == "1"


# --- finding 5b: the build sees only installations the node vouches for ---

def test_a_job_interpreter_below_a_private_directory_is_exposed_only_when_listed(tmp_path: Path) -> None:
    """/root/x/bin/tool (root's, unwritable) exposes nothing of /root/x to the build's uid; listed
    with --allowed-python, its installation is exposed."""
    private = tmp_path / "private"  # tmp_path's parents are 0700: a private directory above it
    tool = private / "x" / "bin" / "tool"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    spec = make_spec(nproc_per_node=1, gpu_indices=[0])
    run = Part(spec, AttemptPaths(tmp_path / "a", tmp_path / "w"), stop_grace_s=1.0,
                     confinement=Confinement(uid=UID + 4, gid=UID + 4))
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, python=str(tool))
    unlisted = run._builder(node)
    assert unlisted is not None and str(private / "x") not in unlisted.expose
    listed = run._builder(NodeContext(**{**node.__dict__, "allowed_pythons": (str(tool),)}))
    assert listed is not None and str(private / "x") in listed.expose


def test_a_part_stopped_while_another_builds_its_venv_stops_waiting_and_builds_nothing(tmp_path: Path) -> None:
    """The venv's lock held by another build: a part waiting for it gives up once stopped (it would
    otherwise wait for that whole build, holding its GPUs), and builds nothing."""
    cache = EnvCache(tmp_path / "envs")
    requirements = "tinypkg==1.0\n"
    key, _, _ = cache.key(requirements, sys.executable)
    stopped, outcome = threading.Event(), queue.Queue[BaseException | None]()

    def wait_then_stop() -> None:
        try:
            cache.acquire(requirements, sys.executable, cancelled=stopped.is_set)
            outcome.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.put(exc)

    cache.root.mkdir(parents=True)
    with cache._key_lock(key):  # another part's build, as far as this one can tell
        waiter = threading.Thread(target=wait_then_stop, daemon=True)
        waiter.start()
        with pytest.raises(queue.Empty):
            outcome.get(timeout=0.5)  # waiting for the lock
        stopped.set()
        raised = outcome.get(timeout=10)
    waiter.join(10)
    assert isinstance(raised, EnvBuildFailed) and "stopped" in str(raised), raised
    assert not (cache.root / key).exists() and not cache.in_use()
