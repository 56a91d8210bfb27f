"""Worker isolation (issue 11, finding 1) piece by piece, on real processes, uids and cgroups: the uid
pool, confine_exec.py, cgroup tracking and its uid fallback, and the agent reading what a worker
wrote. The whole of it, on a real cluster, is tests/e2e/test_isolation.py."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from node_agent.confinement import processes, safe_files
from node_agent.confinement.cgroups import AttemptCgroup, CgroupTree, cgroup2_dir
from node_agent.confinement.isolation import (
    CONFINE_EXEC,
    Confinement,
    Isolation,
    IsolationError,
    UidPool,
    UidRange,
    account_problem,
    hidden_paths,
    make_worker_dir,
    remove_worker_dir,
    scrub_uid_files,
    short_tmp,
    worker_paths,
    worker_tmp,
)
from node_agent.part.attempt import Part
from node_agent.part.commands import AttemptPaths, NodeContext, worker_env
from node_agent.part.logs import LogTailer
from tests.helpers import wait_for
from tests.node_agent.helpers import make_spec
from trainyard.protocol.agent import LaunchSpec
from trainyard.protocol.env import ENV_ATTEMPT_ID, ENV_NODE_ID, ENV_NODE_RANK

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")
UID = 20150  # the tests' own corner of the dev pool (trainyard.dev.DEV_WORKER_UIDS)


def test_uid_ranges() -> None:
    assert UidRange.parse("20000-20063") == UidRange(20000, 20063) and len(UidRange(5, 5)) == 1
    assert str(UidRange.parse(" 7 ")) == "7-7"
    for bad in ("0-5", "9-3", "a-b", "1-70000", ""):
        with pytest.raises(ValueError):
            UidRange.parse(bad)
    taken = next(entry for entry in pwd.getpwall() if entry.pw_uid > 0)
    assert taken.pw_name in (account_problem(UidRange(taken.pw_uid, taken.pw_uid)) or "")
    assert account_problem(UidRange(UID, UID + 3)) is None


def test_a_uid_is_leased_once_and_never_while_a_process_of_it_lives(tmp_path: Path) -> None:
    first, second = UidPool(UidRange(UID, UID + 2), tmp_path), UidPool(UidRange(UID, UID + 2), tmp_path)
    alive = {UID}  # a process of UID lives: not leased, whoever asks
    a = first.lease(lambda: alive)
    b = second.lease(lambda: alive)  # another agent of the machine, same pool: locks keep them apart
    assert a is not None and b is not None and {a.uid, b.uid} == {UID + 1, UID + 2}
    assert first.lease(lambda: alive) is None  # exhausted
    assert second.claim(a.uid) is None  # held by the other agent
    a.close()
    again = second.lease(lambda: alive)
    assert again is not None and again.uid == a.uid and again.gid == again.uid
    assert first.lease(lambda: set()) is not None  # UID, once nothing of it lives
    assert stat_mode(tmp_path) == 0o700


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def _confined_python(confinement: Confinement, code: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    command = confinement.wrap([sys.executable, "-c", code])
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False, **kwargs)  # type: ignore[call-overload, no-any-return]


@root_only
def test_a_confined_process_is_its_uid_alone_in_its_cgroup_and_cannot_regain_privileges(tmp_path: Path) -> None:
    tree, why = CgroupTree.detect()
    assert tree is not None, why  # this machine (and CI) have a writable cgroup v2
    cgroup = tree.for_part("test-node", f"att-{os.getpid()}", 0)
    cgroup.create()
    confinement = Confinement(uid=UID, gid=UID, cgroup=cgroup, expose=worker_paths(os.getcwd()))
    code = (
        "import json, os\n"
        "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "old = os.umask(0); print(json.dumps({'ids': [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],\n"
        " 'groups': os.getgroups(), 'nnp': status['NoNewPrivs'].strip(), 'umask': old,\n"
        " 'cgroup': open('/proc/self/cgroup').read().split('0::', 1)[1].strip(), 'root': root}))\n"
    )
    code = "import os\ntry:\n    root = os.listdir('/root')\nexcept OSError:\n    root = None\n" + code
    try:
        done = _confined_python(confinement, code, env={"PYTHONPATH": os.getcwd()})
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        assert seen["ids"] == [UID] * 4 and seen["groups"] == []
        assert seen["nnp"] == "1" and seen["umask"] == 0o077
        assert cgroup.path.as_posix().endswith(seen["cgroup"])
        # A private /root stays private: at most what was exposed of it shows.
        exposed = {Path(p).relative_to("/root").parts[0] for p in confinement.expose if p.startswith("/root/")}
        assert seen["root"] is None or set(seen["root"]) == exposed
    finally:
        cgroup.remove()


@root_only
def test_the_cgroup_holds_escapees_and_one_kill_ends_them_all() -> None:
    """Finding 1: a worker that starts a session of its own with an empty environment carries no
    marker, yet it stays in the attempt's cgroup, is counted as the attempt's, and is killed with it."""
    tree, _ = CgroupTree.detect()
    assert tree is not None
    cgroup = tree.for_part("test-node", f"esc-{os.getpid()}", 0)
    cgroup.create()
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen(['/bin/sleep', '600'], env={}, start_new_session=True)\n"
            "print(p.pid, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen(Confinement(uid=UID, gid=UID, cgroup=cgroup, expose=worker_paths(os.getcwd()))
                            .wrap([sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        escapee = int(proc.stdout.readline())
        assert {proc.pid, escapee} <= cgroup.pids()
        assert psutil.Process(escapee).environ() == {} and os.getsid(escapee) != os.getsid(proc.pid)
        cgroup.signal(signal.SIGKILL)
        proc.wait(10)
        wait_for(lambda: not cgroup.pids() and not psutil.pid_exists(escapee), timeout=10, what="all gone")
        assert cgroup.remove()
    finally:
        proc.kill()
        cgroup.signal(signal.SIGKILL)


@root_only
def test_a_process_in_a_parts_cgroup_is_that_parts_whatever_its_environment_says() -> None:
    """The scan reads a confined process's part from its cgroup and never its environment (which
    waits on the process's memory map lock: a fork bomb made each scan of every agent on its node take
    half a minute, and a registration with it); a marker naming another attempt changes nothing.
    A process outside every part's cgroup is still found by its marker."""
    tree, _ = CgroupTree.detect()
    assert tree is not None
    attempt_id = f"att-cg{os.getpid()}"
    cgroup = tree.for_part("node-scan", attempt_id, 3)
    cgroup.create()
    lie = {**os.environ, ENV_NODE_ID: "node-other", ENV_ATTEMPT_ID: "att-lie", ENV_NODE_RANK: "9"}
    marked = {**os.environ, ENV_NODE_ID: "node-scan", ENV_ATTEMPT_ID: f"{attempt_id}-free", ENV_NODE_RANK: "0"}
    confined = subprocess.Popen(["/bin/sh", "-c", f"echo $$ > {cgroup.path}/cgroup.procs && exec sleep 600"], env=lie)
    free = subprocess.Popen(["sleep", "600"], env=marked)
    try:
        wait_for(lambda: confined.pid in cgroup.pids(), timeout=10, what="the process to join its cgroup")
        assert processes.part_of(confined.pid) == ("node-scan", attempt_id, "3")
        assert processes.part_of(free.pid) is None
        table = processes.scan()
        assert confined.pid in table.by_part[(attempt_id, "3")]
        assert confined.pid in table.by_node[("node-scan", attempt_id)]
        assert confined.pid not in table.by_attempt.get("att-lie", set())
        assert free.pid in table.by_node[("node-scan", f"{attempt_id}-free")]
    finally:
        for proc in (confined, free):
            proc.kill()
            proc.wait(10)
        wait_for(cgroup.remove, timeout=10, what="the cgroup to empty")


def test_cgroup2_dir_is_found_in_mountinfo() -> None:
    mountinfo = ("35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
                 "36 24 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n")
    assert cgroup2_dir(mountinfo, "1:cpu:/\n0::/system.slice/agent.service\n") == Path(
        "/sys/fs/cgroup/unified/system.slice/agent.service")
    assert cgroup2_dir(mountinfo.splitlines()[1], "0::/") is None  # no unified hierarchy
    assert cgroup2_dir(mountinfo, "1:cpu:/\n") is None


def _run_with(confinement: Confinement, tmp_path: Path, spec: LaunchSpec | None = None) -> Part:
    spec = spec or make_spec(nproc_per_node=1, gpu_indices=[0])
    paths = AttemptPaths(tmp_path / "a", tmp_path / "w")
    return Part(spec, paths, stop_grace_s=1.0, confinement=confinement)


def test_without_a_cgroup_every_process_of_the_leased_uid_is_the_attempts(tmp_path: Path) -> None:
    """The fallback where cgroup v2 is not writable: tracked by uid, signalled by pid, never by group."""
    lease = UidPool(UidRange(UID + 10, UID + 10), tmp_path / "locks").lease(set)
    assert lease is not None
    run = _run_with(Confinement(uid=lease.uid, gid=lease.gid, lease=lease), tmp_path)
    table = processes.ProcessTable()
    table.by_uid[lease.uid] |= {4001, 4002}
    table.by_uid[0] |= {1}
    table.by_part[(run.attempt_id, "0")] |= {4003}  # a marker alone (forged by anyone) counts for nothing
    table.pgid_of.update({4001: 4001, 4002: 4001, 4003: 4003})
    assert run._refresh(table) and run._members == {4001, 4002}
    lease.close()  # another agent holds the uid now (after a restart): its processes are not ours
    assert not Confinement(uid=lease.uid, gid=lease.gid, lease=lease).owns_uid
    unconfined = _run_with(Confinement(), tmp_path, run.spec)
    assert unconfined._refresh(table) and unconfined._members == {4003}


@root_only
def test_uid_tracking_stops_a_real_escapee(tmp_path: Path) -> None:
    lease = UidPool(UidRange(UID + 11, UID + 11), tmp_path / "locks").lease(processes.uids_alive)
    assert lease is not None
    confinement = Confinement(uid=lease.uid, gid=lease.gid, lease=lease, expose=worker_paths(os.getcwd()))
    run = _run_with(confinement, tmp_path)
    code = ("import subprocess; print(subprocess.Popen(['/bin/sleep', '600'], env={}, start_new_session=True, "
            "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)")
    done = _confined_python(confinement, code)
    escapee = int(done.stdout)
    try:
        assert run._refresh(processes.scan()) and escapee in run._members
        run._signal(signal.SIGKILL)
        wait_for(lambda: not run._refresh(processes.scan()), timeout=10, what="the uid's processes to go")
    finally:
        with_kill(escapee)
        lease.close()


def with_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_files_a_worker_planted_are_not_read(tmp_path: Path) -> None:
    """A worker owns its directory: links, FIFOs, another owner's files and huge files are refused,
    and reading never blocks."""
    worker = tmp_path / "w"
    make_worker_dir(worker, None, None)
    secret = tmp_path / "secret"
    secret.write_text("the agent's join token")
    (worker / "status" / "rank-0.json").symlink_to(secret)
    os.mkfifo(worker / "status" / "rank-1.json")
    (worker / "logs" / "rank-0").symlink_to(tmp_path)
    (worker / "status" / "rank-2.json").write_text("x" * 100)
    for name in ("rank-0.json", "rank-1.json"):
        with pytest.raises(OSError):
            safe_files.read_file(worker, "status", name, limit=1000)
    with pytest.raises(safe_files.UnsafeFile):
        safe_files.read_file(worker, "status", "rank-2.json", limit=10)
    with pytest.raises(safe_files.UnsafeFile):
        safe_files.read_file(worker, "status", "rank-2.json", limit=1000, owner=os.geteuid() + 1)
    assert safe_files.read_file(worker, "status", "rank-2.json", limit=1000, owner=os.geteuid()) == b"x" * 100
    with pytest.raises(OSError):
        safe_files.read_file(worker, "status", "..", "secret", limit=1000)
    # The log tailer ships nothing through a planted link; a real log file still goes.
    (worker / "logs" / "rank-1").mkdir()
    (worker / "logs" / "rank-1" / "stdout.log").symlink_to(secret)
    (worker / "logs" / "rank-3").mkdir()
    (worker / "logs" / "rank-3" / "stdout.log").write_text("hello\n")
    batch = LogTailer(worker / "logs").next_batch()
    assert [(c.chunk.rank, c.chunk.data) for c in batch] == [(3, "hello\n")]
    # Rank files: only valid ones of this part's ranks count.
    (worker / "status" / "rank-3.json").write_text(json.dumps({"rank": 0, "local_rank": 0, "state": "running"}))
    (worker / "status" / "rank-0x.json").write_text("{}")
    good = {"rank": 0, "local_rank": 0, "pid": 5, "state": "running"}
    run = _run_with(Confinement(), tmp_path)
    assert run.paths.worker == worker
    (worker / "status" / "rank-0.json").unlink()
    (worker / "status" / "rank-0.json").write_text(json.dumps(good))
    started = time.monotonic()
    assert [w.pid for w in run._read_rank_files()] == [5]  # rank-3.json claims rank 0: ignored
    assert time.monotonic() - started < 2  # the FIFO did not block


@root_only
def test_a_released_uid_leaves_nothing_in_shared_directories(tmp_path: Path) -> None:
    shared = tmp_path / "tmp"
    shared.mkdir()
    for name, owner in (("mine", UID + 20), ("dir", UID + 20), ("other", UID + 21), ("roots", 0)):
        path = shared / name
        if name == "dir":
            path.mkdir()
            (path / "inside").write_text("x")
        else:
            path.write_text("x")
        os.lchown(path, owner, owner)
    removed = scrub_uid_files(UID + 20, (str(shared),))
    assert sorted(Path(p).name for p in removed) == ["dir", "mine"]
    assert sorted(p.name for p in shared.iterdir()) == ["other", "roots"]


@root_only
def test_a_worker_directory_is_private_to_its_uid(tmp_path: Path) -> None:
    worker = tmp_path / "w"
    make_worker_dir(worker, UID, UID)
    for path in (worker, *(worker / n for n in ("home", "tmp", "status", "logs"))):
        assert path.stat().st_uid == UID and stat_mode(path) == 0o700


def test_a_pool_without_root_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(IsolationError, match="needs an agent running as root"):
        Isolation.configure(UidRange(UID, UID), tmp_path, use_cgroups=False, cwd=str(tmp_path))
    isolation, notes = Isolation.configure(None, tmp_path, use_cgroups=False, cwd=str(tmp_path))
    assert not isolation.isolated and notes == []


@pytest.mark.parametrize("where", ["confinement/confine_exec.py", "confine_exec.py"])
def test_confine_exec_refuses_bad_arguments(where: str) -> None:
    """As the agent runs it; and by its earlier path, an alias for an agent that still runs while its
    package is upgraded in place (node_agent/ranks/entry_points.py)."""
    script = Path(__file__).resolve().parents[2] / "node_agent" / where
    if where.startswith("confinement/"):
        assert str(script) == CONFINE_EXEC
    for args in (["--uid", "5", "--", "/bin/true"], ["--cgroup"], ["--uid", "x", "--gid", "1", "--", "a"], []):
        done = subprocess.run([sys.executable, "-I", "-S", str(script), *args], capture_output=True, text=True,
                              timeout=30, check=False)
        assert done.returncode == 126 and done.stderr.startswith("trainyard confine: "), (args, done.stderr)


def test_attempt_cgroup_api_on_a_plain_directory(tmp_path: Path) -> None:
    """The cgroup's bookkeeping (not the kernel's part): pids from every cgroup.procs below it."""
    cgroup = AttemptCgroup(tmp_path / "cg")
    cgroup.create()
    (cgroup.path / "cgroup.procs").write_text("11\n12\n")
    (cgroup.path / "sub").mkdir()
    (cgroup.path / "sub" / "cgroup.procs").write_text("13\n")
    assert cgroup.pids() == {11, 12, 13}
    assert not cgroup.remove()  # not empty
    assert AttemptCgroup(tmp_path / "gone").pids() == set() and AttemptCgroup(tmp_path / "gone").remove()


@root_only
def test_an_agent_whose_workers_could_not_reach_their_directory_refuses_to_start(tmp_path: Path) -> None:
    from node_agent.agent import Agent, AgentConfig

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    config = AgentConfig(control_plane_url="http://127.0.0.1:9", join_token="j", name="n", address="127.0.0.2",
                         virtual_gpus=1, work_dir=tmp_path / "agent", worker_uids=UidRange(UID + 30, UID + 31),
                         worker_root=private / "workers", run_dir=Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp")))
    agent = Agent(config)
    try:
        with pytest.raises(IsolationError, match="--worker-root"):
            agent.start()
    finally:
        agent.stop(timeout=1)
        shutil.rmtree(config.runtime_dir, ignore_errors=True)


def test_dev_up_finds_out_whether_its_uid_pool_works_here() -> None:
    """``dev up`` (and CI, run as root on any machine) must not fail to start where the pool cannot
    be used: the agents' own start check, run first, says why, and the cluster runs unisolated."""
    from trainyard.dev import _PoolCheck

    account = next(p for p in pwd.getpwall() if p.pw_uid >= 1 and not p.pw_name.startswith("trainyard"))
    problem = _PoolCheck(str(account.pw_uid)).problem()
    assert problem is not None and problem.startswith("IsolationError: ")
    assert (repr(account.pw_name) in problem) if os.geteuid() == 0 else ("running as root" in problem)
    assert _PoolCheck("20000-1").problem() is not None  # ValueError: first > last
    if os.geteuid() == 0:
        assert _PoolCheck(str(UID + 40)).problem() is None  # here it works: the probe ran as that uid


# --- issue 24: DataLoader workers under confinement, whatever the work dir's length ---

DATALOADER = """
import sys, torch
from torch.utils.data import DataLoader, Dataset
class Noisy(Dataset):
    def __len__(self): return 8
    def __getitem__(self, i): return torch.full((4,), float(i)) + torch.rand(4)
if __name__ == "__main__":
    for method in sys.argv[1:]:
        got = sum(len(b) for b in DataLoader(Noisy(), batch_size=2, num_workers=2, multiprocessing_context=method))
        print(method, got, flush=True)
"""


@root_only
def test_dataloader_workers_run_confined_under_a_deep_work_dir(tmp_path: Path) -> None:
    # A project's dev cluster: <project>/.trainyard/dev/nodes/node-2/attempts/<uuid>/worker.
    worker = tmp_path / "my-team-projects" / "image-classifier" / ".trainyard" / "dev" / "nodes" / "node-2" / \
        "attempts" / "0b6f3c1e-5d7a-4e8b-9c2d-1f0a3b4c5d6e" / "worker"
    worker.parent.mkdir(parents=True)
    worker.parent.chmod(0o755)
    make_worker_dir(worker, UID, UID)
    tmp = worker_tmp(worker)
    # worker/tmp leaves less than multiprocessing's socket names need (pymp-XXXXXXXX/listener-XXXXXXXX)
    # under the 107 bytes of a unix socket path; the short one leaves plenty.
    assert len(str(worker / "tmp")) + len("/pymp-xxxxxxxx/listener-xxxxxxxx") > 107
    assert tmp == short_tmp(worker) and len(str(tmp)) < 40
    assert tmp.stat().st_uid == UID and stat_mode(tmp) == 0o700 and stat_mode(tmp.parent) == 0o711
    launched = worker_env(make_spec(nproc_per_node=1, gpu_indices=[0]), NodeContext(local_addr="127.0.0.1",
                          agent_url="http://a:1", virtual=True), AttemptPaths(tmp_path / "a", worker), uid=UID)
    assert launched["TMPDIR"] == str(tmp)  # what torchrun and the workers get
    (worker / "job.py").write_text(DATALOADER)
    os.lchown(worker / "job.py", UID, UID)
    confinement = Confinement(uid=UID, gid=UID, expose=hidden_paths([*worker_paths(os.getcwd()), str(worker)]))
    env = {"PYTHONPATH": os.getcwd(), "HOME": str(worker / "home"), "PATH": os.environ.get("PATH", "/usr/bin")}

    def run(tmpdir: Path) -> subprocess.CompletedProcess[str]:
        command = confinement.wrap([sys.executable, str(worker / "job.py"), "fork", "spawn"])
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=worker,
                              env={**env, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"})

    done = run(tmp)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fork", "8", "spawn", "8"]
    remove_worker_dir(worker)
    assert not worker.exists() and not tmp.exists()
