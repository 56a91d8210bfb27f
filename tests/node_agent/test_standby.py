"""Warm standbys (issue 14): a rank handed to one gets its exact exit code, its signals, the
environment a cold start gives it and nothing of the standby; a standby serves one rank, only a
worker of this agent, confined exactly as the rank's shim; the pool refills and never kills a
standby a rank took. Real processes, uids and cgroups; no torchrun (the e2e test runs a job)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from node_agent.confinement.cgroups import CgroupTree
from node_agent.confinement.isolation import Confinement, UidRange, worker_paths
from node_agent.ranks import standby_wire
from node_agent.ranks.standby_claim import claim
from node_agent.ranks.standby_pool import StandbyPool
from tests.node_agent.helpers import REPO_ROOT, wait_for, write_script

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids needs root")
UID = 20157  # the tests' own corner of the dev pool (trainyard.dev.DEV_WORKER_UIDS)
BASE_ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}

REPORT = """\
import json, os, sys
print(json.dumps({"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path": sys.path,
                  "fds": sorted(int(f) for f in os.listdir("/proc/self/fd"))[:-1], "pid": os.getpid(),
                  "ppid_cmd": open(f"/proc/{os.getppid()}/cmdline").read().split("\\0"),
                  "name": __name__, "torch": "torch" in sys.modules}))
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def start_standby(spawned: list[subprocess.Popen[bytes]], directory: Path, name: str = "a", *flags: str,
                  env: dict[str, str] | None = None) -> Path:
    directory.mkdir(exist_ok=True)
    socket = directory / f"{name}{standby_wire.SOCKET_SUFFIX}"
    command = [sys.executable, "-m", "node_agent.ranks.standby", "--socket", str(socket), "--parent", str(os.getpid()),
               "--preload", "json", *flags]
    spawned.append(subprocess.Popen(command, env={**BASE_ENV, "LEFT_BY_THE_STANDBY": "1", **(env or {})},
                                    start_new_session=True, stdout=subprocess.DEVNULL))
    wait_for(socket.exists, timeout=30, what="the standby listens")
    return socket


def run_shim(spawned: list[subprocess.Popen[bytes]], tmp_path: Path, *args: str, standbys: Path | None,
             job_env: dict[str, str] | None = None, wrap: list[str] | None = None,
             extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = {**BASE_ENV, **(extra_env or {}), "RANK": "0", "LOCAL_RANK": "0",
           "TRAINYARD_STATUS_DIR": str(tmp_path / "status"),
           "TRAINYARD_JOB_ENV": json.dumps(job_env or {"FROM_THE_JOB": "yes"})}
    if standbys is not None:
        env["TRAINYARD_STANDBY_DIR"] = str(standbys)
    command = [sys.executable, "-m", "node_agent.ranks.shim", "--log-dir", str(tmp_path / "logs"), *args]
    proc = subprocess.Popen([*(wrap or []), *command], env=env, cwd=tmp_path, start_new_session=True)
    spawned.append(proc)
    return proc


def record(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "status" / "rank-0.json").read_text())


def report(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "logs" / "rank-0" / "stdout.log").read_text().splitlines()[-1])


def fresh(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    return path


def test_a_rank_runs_in_a_standby_once_with_its_exact_exit_code_and_a_cold_starts_env(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    standbys = tmp_path / "standbys"
    socket = start_standby(spawned, standbys)
    cold_dir, warm_dir, again_dir = fresh(tmp_path, "cold"), fresh(tmp_path, "warm"), fresh(tmp_path, "again")
    script = write_script(tmp_path, "report.py", REPORT)

    assert run_shim(spawned, cold_dir, "file", str(script), "3", standbys=None).wait(30) == 3
    assert run_shim(spawned, warm_dir, "file", str(script), "3", standbys=standbys).wait(30) == 3
    cold = report(cold_dir)
    warm = json.loads(json.dumps(report(warm_dir)).replace(str(warm_dir), str(cold_dir)))  # the one difference
    assert "standby" not in record(cold_dir) and record(warm_dir)["standby"] is True
    assert record(warm_dir)["exit_code"] == 3 and record(warm_dir)["pid"] == warm["pid"]
    assert "node_agent.ranks.standby" in warm["ppid_cmd"]  # it did run in the standby
    # Exactly what a cold start sees: nothing of the standby's environment, fds or path.
    assert warm["env"] == cold["env"] and "LEFT_BY_THE_STANDBY" not in warm["env"]
    assert warm["env"]["FROM_THE_JOB"] == "yes" and "TRAINYARD_STANDBY_DIR" not in warm["env"]
    assert (warm["argv"], warm["name"], warm["fds"]) == (cold["argv"], cold["name"], cold["fds"]) == (
        [str(script), "3"], "__main__", [0, 1, 2])
    assert warm["path"] == cold["path"] and warm["cwd"] == cold["cwd"] == str(cold_dir)
    # Used once: its socket is gone, it exits once it reported, and the next rank starts cold.
    assert not socket.exists() and standby_wire.claimed_path(socket).exists()
    assert spawned[0].wait(10) == 0
    assert run_shim(spawned, again_dir, "file", str(script), "0", standbys=standbys).wait(30) == 0
    assert "standby" not in record(again_dir) and record(again_dir)["exit_code"] == 0


@pytest.mark.parametrize(("body", "expected"), [
    ("raise RuntimeError('boom')", 1),
    ("import os; os._exit(4)", 4),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9),
])
def test_every_kind_of_exit_is_reported_exactly(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]], body: str, expected: int
) -> None:
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys)
    script = write_script(tmp_path, "end.py", body + "\n")
    shim = run_shim(spawned, tmp_path, "file", str(script), standbys=standbys)
    assert shim.wait(30) == (128 - expected if expected < 0 else expected)
    assert record(tmp_path)["standby"] is True and record(tmp_path)["exit_code"] == expected
    if expected == 1:
        assert "RuntimeError: boom" in (tmp_path / "logs" / "rank-0" / "stderr.log").read_text()


def test_signals_to_the_shim_reach_the_standby_worker_and_atexit_runs(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys)
    (tmp_path / "pkg").mkdir()
    write_script(tmp_path / "pkg", "__init__.py", "")
    write_script(tmp_path / "pkg", "slow.py", (
        "import atexit, pathlib, signal, sys, time\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(17))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"))
    shim = run_shim(spawned, tmp_path, "module", "pkg.slow", standbys=standbys)
    wait_for((tmp_path / "ready").exists, timeout=30, what="the worker runs")
    assert record(tmp_path)["state"] == "running" and record(tmp_path)["standby"] is True
    shim.send_signal(signal.SIGTERM)
    assert shim.wait(30) == 17
    assert record(tmp_path)["exit_code"] == 17
    assert "atexit ran" in (tmp_path / "logs" / "rank-0" / "stdout.log").read_text()


def test_a_stop_sent_to_every_process_of_the_rank_is_the_workers_to_handle(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """The agent stops an attempt by signalling its cgroup (or uid): the standby that runs the
    worker gets the SIGTERM too, and must not die of it (its worker would be SIGKILLed with it)."""
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys)
    script = write_script(tmp_path, "graceful.py", (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.3), sys.exit(17)))\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"))
    shim = run_shim(spawned, tmp_path, "file", str(script), standbys=standbys)
    wait_for((tmp_path / "ready").exists, timeout=30, what="the worker runs")
    worker = record(tmp_path)["pid"]
    standby = psutil.Process(worker).ppid()
    assert standby == spawned[0].pid
    for pid in (shim.pid, standby, worker):
        os.kill(pid, signal.SIGTERM)
    assert shim.wait(30) == 17
    assert record(tmp_path)["exit_code"] == 17


def test_a_standby_declines_other_startup_variables_and_stays_warm(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    standbys = tmp_path / "standbys"
    socket = start_standby(spawned, standbys)
    script = write_script(tmp_path, "report.py", REPORT)
    first, second = fresh(tmp_path, "first"), fresh(tmp_path, "second")
    # MKL reads MKL_NUM_THREADS when it loads: a standby that imported with another value differs.
    assert run_shim(spawned, first, "file", str(script), "0", standbys=standbys,
                    job_env={"MKL_NUM_THREADS": "7"}).wait(30) == 0
    assert "standby" not in record(first) and report(first)["env"]["MKL_NUM_THREADS"] == "7"
    assert socket.exists()
    assert run_shim(spawned, second, "file", str(script), "0", standbys=standbys).wait(30) == 0
    assert record(second)["standby"] is True


THREADS = """\
import json, os, sys, torch
print(json.dumps({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                  "cpus": len(os.sched_getaffinity(0)), "warm": "node_agent.ranks.standby" in
                  open(f"/proc/{os.getppid()}/cmdline").read()}))
"""


def test_a_warm_rank_gets_the_intra_op_threads_a_cold_one_would(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """A standby imports torch with OMP_NUM_THREADS=1 (more would start threads before its fork);
    the worker gets the rank's value, or without one OpenMP's default, as a cold start would."""
    standbys = tmp_path / "standbys"
    script = write_script(tmp_path, "threads.py", THREADS)
    seen = {}
    for name, job_env in (("three", {"OMP_NUM_THREADS": "3"}), ("unset", {})):
        for how in ("cold", "warm"):
            directory = fresh(tmp_path, f"{name}-{how}")
            if how == "warm":
                start_standby(spawned, standbys, name, "--preload", "torch", env={"OMP_NUM_THREADS": "1"})
            assert run_shim(spawned, directory, "file", str(script), standbys=standbys if how == "warm" else None,
                            job_env=job_env).wait(60) == 0
            seen[name, how] = report(directory)
    assert seen["three", "warm"]["warm"] and seen["unset", "warm"]["warm"] and not seen["unset", "cold"]["warm"]
    assert seen["three", "warm"]["threads"] == seen["three", "cold"]["threads"] == min(3, os.cpu_count() or 3)
    assert seen["unset", "warm"]["omp"] is None
    assert seen["unset", "warm"]["threads"] == seen["unset", "cold"]["threads"] == seen["unset", "cold"]["cpus"]


def test_only_a_worker_uid_may_claim(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    standbys = tmp_path / "standbys"
    # A root agent with a pool serves pool uids only: this (root) process is declined, fds and all.
    socket = start_standby(spawned, standbys, "pool", "--uids", f"{UID}-{UID}")
    r, w = os.pipe()
    worker, why = claim(standbys, "file", "/x.py", [], {"PYTHONUNBUFFERED": "1"}, cwd="/", stdio=[w, w])
    os.close(r), os.close(w)
    assert worker is None and "not a worker uid" in why and socket.exists()


@root_only
def test_a_standby_worker_takes_on_the_claimants_uid_cgroup_and_mount_namespace(
    spawned: list[subprocess.Popen[bytes]]
) -> None:
    tree, why = CgroupTree.detect()
    assert tree is not None, why
    cgroup = tree.for_part("standby-test", f"att-{os.getpid()}", 0)
    cgroup.create()
    work = Path("/tmp") / f"standby-{os.getpid()}"  # every directory above it must let the uid through
    try:
        work.mkdir(mode=0o755)
        for name in ("standbys", "status", "logs"):
            (work / name).mkdir(mode=0o755)
        for name in ("status", "logs"):
            os.chown(work / name, UID, UID)
        start_standby(spawned, work / "standbys", "c", "--uids", f"{UID}-{UID}", "--cgroup-base", str(tree.base))
        script = write_script(work, "who.py", (
            "import json, os, sys\n"
            "status = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "old = os.umask(0)\n"
            "print(json.dumps({'ids': [os.getuid(), os.geteuid(), os.getgid(), os.getegid()], 'groups': os.getgroups(),"
            " 'nnp': status['NoNewPrivs'].strip(), 'umask': old, 'mnt': os.readlink('/proc/self/ns/mnt'),"
            " 'cgroup': open('/proc/self/cgroup').read().split('0::', 1)[1].strip()}))\n"))
        os.chmod(script, 0o644)
        confinement = Confinement(uid=UID, gid=UID, cgroup=cgroup, expose=worker_paths(os.getcwd()))
        prefix = confinement.wrap(["program"])[:-1]  # confine_exec.py ... --
        shim = run_shim(spawned, work, "file", str(script), standbys=work / "standbys", wrap=prefix)
        assert shim.wait(30) == 0
        seen = json.loads((work / "logs" / "rank-0" / "stdout.log").read_text())
        assert record(work)["standby"] is True
        assert seen["ids"] == [UID] * 4 and seen["groups"] == [] and seen["nnp"] == "1" and seen["umask"] == 0o077
        assert cgroup.path.as_posix().endswith(seen["cgroup"])
        assert seen["mnt"] != os.readlink("/proc/self/ns/mnt")  # the shim's own (exposing) namespace
    finally:
        cgroup.signal(signal.SIGKILL)
        wait_for(lambda: not cgroup.pids(), timeout=10, what="the cgroup is empty")
        cgroup.remove()
        subprocess.run(["rm", "-rf", str(work)], check=False)


def test_the_pool_refills_what_ranks_took_and_kills_only_idle_standbys(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    directory = tmp_path / "pool"
    pool = StandbyPool(size=2, directory=directory, python=sys.executable, env=dict(BASE_ENV), cwd=str(tmp_path),
                       preload=("json",))
    try:
        wait_for(lambda: (pool.refill(), pool.warm)[1] == 2, timeout=30, what="two warm standbys")
        first = sorted(directory.glob("*.sock"))
        script = write_script(tmp_path, "slow.py", "import pathlib, time\npathlib.Path('ready').write_text('1')\n"
                              "time.sleep(60)\n")
        shim = run_shim(spawned, tmp_path, "file", str(script), standbys=directory)
        wait_for((tmp_path / "ready").exists, timeout=30, what="the worker runs")
        zygote = pool.zygote_pid
        assert zygote is not None
        # The agent's pipes to the zygote are the zygote's alone: neither the claimed standby nor
        # its worker holds one (a worker could otherwise feed the zygote socket paths).
        pipes = {os.readlink(f"/proc/{zygote}/fd/{fd}") for fd in (0, 1)}
        claimed = [pid for pid in spawned_by(pool) if pid not in (s.pid for s in pool._standbys if s.ours)]
        worker = psutil.Process(claimed[0]).children()[0].pid
        for pid in (claimed[0], worker):
            held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            assert not held & pipes, (pid, held)
        # A part of the node is starting: the replacement is a fork of the zygote (no imports beside
        # its ranks), so even then it comes at once, from the same zygote.
        pool.refill(hold=True)
        assert pool.kept == 2 and len(spawned_by(pool)) == 3 and pool.zygote_pid == zygote
        wait_for(lambda: (pool.refill(), pool.warm)[1] == 2, timeout=30, what="a fork in place of the one taken")
        assert len(set(directory.glob("*.sock")) - set(first)) == 1
        assert all(parent_of(pid) == zygote for pid in spawned_by(pool))
        worker_pid = record(tmp_path)["pid"]
        pool.close()  # the zygote and the idle standbys killed
        assert not list(directory.glob("*.sock"))
        time.sleep(0.5)  # what dies with the zygote dies by a signal delivered after it
        # The rank's claimed standby and its worker live on, though their zygote is gone.
        assert not gone_or_zombie(claimed[0]) and not gone_or_zombie(worker_pid) and worker_pid == worker
        assert shim.poll() is None
    finally:
        pool.close()


def spawned_by(pool: StandbyPool) -> list[int]:
    return [s.pid for s in pool._standbys]  # noqa: SLF001 - what the pool started, claimed or not


def gone_or_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_pool_whose_zygote_dies_turns_itself_off(tmp_path: Path) -> None:
    pool = StandbyPool(size=1, directory=tmp_path / "pool", python=sys.executable, env=dict(BASE_ENV),
                       cwd=str(tmp_path), preload=("no_such_module_anywhere",), uids=UidRange(UID, UID))
    try:
        started = set()
        for _ in range(5):
            pool.refill()
            zygote = pool._zygote  # noqa: SLF001
            if zygote is not None:
                started.add(zygote.proc.pid)
                zygote.proc.wait(30)
        assert pool.disabled is not None and "died" in pool.disabled and len(started) == 3
    finally:
        pool.close()


def test_killed_standbys_are_replaced_by_forks_and_a_killed_zygote_by_a_new_one(tmp_path: Path) -> None:
    """The zygote imports once; what dies unclaimed is forked again, and a dead zygote is started
    again (one failure, however many of its standbys died with it)."""
    pool = StandbyPool(size=2, directory=tmp_path / "pool", python=sys.executable, env=dict(BASE_ENV),
                       cwd=str(tmp_path), preload=("json",))
    try:
        wait_for(lambda: (pool.refill(), pool.warm)[1] == 2, timeout=30, what="two warm standbys")
        zygote, first = pool.zygote_pid, spawned_by(pool)
        assert zygote is not None and all(parent_of(pid) == zygote for pid in first)
        os.kill(first[0], signal.SIGKILL)
        wait_for(lambda: (pool.refill(), first[0] not in spawned_by(pool) and pool.warm == 2)[1], timeout=30,
                 what="a fork in place of the killed standby")
        assert pool.zygote_pid == zygote and pool.disabled is None
        os.kill(zygote, signal.SIGKILL)
        wait_for(lambda: (pool.refill(), pool.zygote_pid not in (None, zygote) and pool.warm == 2)[1],
                 timeout=30, what="a new zygote and its standbys")
        assert pool.disabled is None
        wait_for(lambda: all(gone_or_zombie(pid) for pid in first[1:]), timeout=10,
                 what="the dead zygote's idle standby gone with it")
    finally:
        pool.close()


@pytest.mark.parametrize(("kind", "source"), [
    ("file", "import no_such_module_here\n"),
    ("file", "def main(:\n"),
    ("file", "def main():\n    raise ValueError('lr must be positive')\nmain()\n"),
    ("module", None),
])
def test_a_failure_in_a_standby_is_classified_as_a_cold_one(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]], kind: str, source: str | None
) -> None:
    """The control plane fails a job at once on a start error and shows the worker's own words:
    a standby's extra frames (runpy, the standby) must change neither."""
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys)
    entrypoint = str(write_script(tmp_path, "train.py", source)) if source is not None else "no_such_entrypoint"
    seen = []
    for name, directory in (("cold", None), ("warm", standbys)):
        run = fresh(tmp_path, name)
        assert run_shim(spawned, run, kind, entrypoint, standbys=directory).wait(30) == 1
        seen.append(record(run))
    cold, warm = seen
    assert "standby" not in cold and warm["standby"] is True
    assert (warm["exit_code"], warm["cause"], warm["message"]) == (cold["exit_code"], cold["cause"], cold["message"])


def test_a_module_runs_in_a_fresh_main_and_fails_with_a_cold_traceback(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """`python -m` runs the module in __main__: the standby's own module, unless replaced."""
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys)
    seen = []
    for name, directory in (("cold", None), ("warm", standbys)):
        run = fresh(tmp_path, name)
        (run / "pkg").mkdir()  # found from the cwd, as `python -m` finds it
        write_script(run / "pkg", "__init__.py", "")
        write_script(run / "pkg", "boom.py", (
            "import sys\n"
            "print(sorted(k for k in globals() if k != '__loader__'), file=sys.stderr)\n"
            "def main():\n    raise RuntimeError('boom')\n"
            "main()\n"))
        assert run_shim(spawned, run, "module", "pkg.boom", standbys=directory).wait(30) == 1
        seen.append(((run / "logs" / "rank-0" / "stderr.log").read_text(), record(run)))
    (cold, cold_record), (warm, warm_record) = seen
    assert warm_record["standby"] is True and warm.replace("/warm", "/cold") == cold
    assert "RuntimeError: boom" in warm and "node_agent" not in warm
    assert (warm_record["cause"], warm_record["message"]) == (
        cold_record["cause"], cold_record["message"])


def test_what_the_preloaded_modules_cached_of_the_standbys_environment_is_not_the_workers(
    tmp_path: Path, spawned: list[subprocess.Popen[bytes]]
) -> None:
    """A preload that asked for the temporary directory while importing cached the standby's:
    the worker's files must go to its own TMPDIR (the attempt's private one under an agent)."""
    (tmp_path / "mods").mkdir()
    write_script(tmp_path / "mods", "asks_tmp.py", "import tempfile\nCACHED = tempfile.gettempdir()\n")
    (tmp_path / "standby-tmp").mkdir()
    standbys = tmp_path / "standbys"
    socket = standbys / f"t{standby_wire.SOCKET_SUFFIX}"
    standbys.mkdir()
    spawned.append(subprocess.Popen(
        [sys.executable, "-m", "node_agent.ranks.standby", "--socket", str(socket), "--parent", str(os.getpid()),
         "--preload", "asks_tmp"],
        env={**BASE_ENV, "PYTHONPATH": f"{REPO_ROOT}:{tmp_path / 'mods'}", "TMPDIR": str(tmp_path / "standby-tmp")},
        start_new_session=True))
    wait_for(socket.exists, timeout=30, what="the standby listens")
    script = write_script(tmp_path, "tmp.py", "import tempfile\nprint(tempfile.gettempdir())\n")
    run = fresh(tmp_path, "run")
    (run / "own-tmp").mkdir()
    assert run_shim(spawned, run, "file", str(script), standbys=standbys,
                    extra_env={"TMPDIR": str(run / "own-tmp")}).wait(30) == 0  # as the agent sets it
    assert record(run)["standby"] is True
    assert (run / "logs" / "rank-0" / "stdout.log").read_text().strip() == str(run / "own-tmp")


def _torchrun(spawned: list[subprocess.Popen[bytes]], tmp_path: Path, standbys: Path, script: Path) -> \
        subprocess.Popen[bytes]:
    """node_agent.ranks.torchrun_entry as the agent starts it (one node, one rank under the shim)."""
    env = {**BASE_ENV, "TRAINYARD_STATUS_DIR": str(tmp_path / "status"), "TRAINYARD_JOB_ENV": "{}",
           "TRAINYARD_STANDBY_DIR": str(standbys), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    (tmp_path / "status").mkdir(exist_ok=True)
    command = [sys.executable, "-m", "node_agent.ranks.torchrun_entry", "--", "--standalone", "--nproc-per-node", "1",
               "--max-restarts", "0", "--monitor-interval", "0.1", "-m", "node_agent.ranks.shim",
               "--log-dir", str(tmp_path / "logs"), "file", str(script)]
    with (tmp_path / "torchrun.stderr.log").open("ab") as err:
        proc = subprocess.Popen(command, env=env, cwd=tmp_path, start_new_session=True, stderr=err,
                                stdout=subprocess.DEVNULL)
    spawned.append(proc)
    return proc


def test_torchrun_starts_in_a_standby_and_dies_with_it(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """Issue 30's fast path: torchrun_entry hands torchrun to a warm standby and stands in for it
    (the same exit status; the pids it records); a standby killed under a running torchrun (the
    replacement process dying during a recovery) takes torchrun, the rank shim and the worker with
    it, and the stand-in dies by the same signal, which the agent reads as torchrun's failure."""
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys, "a", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    script = write_script(tmp_path, "slow.py", "import pathlib, time\npathlib.Path('ready').write_text('1')\n"
                          "time.sleep(60)\n")
    launcher = _torchrun(spawned, tmp_path, standbys, script)
    wait_for((tmp_path / "ready").exists, timeout=60, what="the worker runs")
    said = json.loads((tmp_path / "status" / "launcher.json").read_text())
    standby, torchrun = psutil.Process(said["standby"]), psutil.Process(said["torchrun"])
    assert said["launcher"] == launcher.pid and torchrun.ppid() == standby.pid
    assert "node_agent.ranks.standby" in " ".join(standby.cmdline())
    worker = psutil.Process(record(tmp_path)["pid"])
    assert "torchrun runs warm" in (tmp_path / "torchrun.stderr.log").read_text()
    standby.kill()
    assert launcher.wait(30) == -signal.SIGKILL
    psutil.wait_procs([torchrun, worker], timeout=30)
    assert not torchrun.is_running() and not worker.is_running()


def test_torchrun_in_a_standby_exits_as_torchrun_does(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """A rank that fails makes torchrun exit 1; its stand-in exits 1 too. No standby: a cold start."""
    standbys = tmp_path / "standbys"
    start_standby(spawned, standbys, "a", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    script = write_script(tmp_path, "fail.py", "import sys\nsys.exit(5)\n")
    warm, cold = fresh(tmp_path, "warm"), fresh(tmp_path, "cold")
    assert _torchrun(spawned, warm, standbys, script).wait(60) == 1
    assert "torchrun runs warm" in (warm / "torchrun.stderr.log").read_text()
    assert json.loads((warm / "status" / "rank-0.json").read_text())["exit_code"] == 5
    assert _torchrun(spawned, cold, standbys, script).wait(60) == 1  # the standby was used: cold
    assert "starts cold: no standby was warm" in (cold / "torchrun.stderr.log").read_text()
    assert not (cold / "status" / "launcher.json").exists()


def test_a_stop_during_torchruns_claim_is_not_lost(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    """A SIGTERM that reaches torchrun_entry while a standby is still answering its claim is kept and
    acted on: here the standby declines, and the cold start the entry falls back to stops at once
    (before, the signal was ignored during the claim and lost)."""
    import socket as sockets
    import threading

    standbys = tmp_path / "standbys"
    standbys.mkdir()
    listener = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    listener.bind(str(standbys / f"slow{standby_wire.SOCKET_SUFFIX}"))
    listener.listen(1)
    asked, answer = threading.Event(), threading.Event()

    def slow_standby() -> None:
        conn, _ = listener.accept()
        _request, fds = standby_wire.receive(conn, with_fds=True)
        for fd in fds:
            os.close(fd)
        asked.set()
        answer.wait(30)
        standby_wire.send(conn, {"declined": "a test's slow standby"})
        conn.close()

    server = threading.Thread(target=slow_standby, daemon=True)
    server.start()
    script = write_script(tmp_path, "never.py", "raise SystemExit('never started')\n")
    launcher = _torchrun(spawned, tmp_path, standbys, script)
    assert asked.wait(30)
    launcher.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # the signal is delivered while the claim waits for its answer
    answer.set()
    assert launcher.wait(30) == -signal.SIGTERM
    said = (tmp_path / "torchrun.stderr.log").read_text()
    assert "starts cold: a standby declined" in said and not (tmp_path / "status" / "rank-0.json").exists()
    listener.close()
