"""Resource limits per attempt part (issue 23, finding 6): the policy, the cgroup files, and four
attacks run as real confined parts (torchrun, a pool uid, the part's cgroups and /dev/shm), each
stopped at its limit with the limit named in the part's failure reason while the node and every
process outside the part live on."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.confinement.cgroups import AGENT_LEAF, LimitGroups, _move_to_leaf, cgroup1_dirs
from node_agent.confinement.isolation import Confinement, Isolation, UidRange, worker_paths
from node_agent.confinement.limits import (
    GiB,
    LimitEvents,
    LimitOptions,
    MiB,
    NodeResources,
    PartLimits,
    format_size,
    limit_options,
    limit_reason,
    parse_size,
    part_limits,
)
from node_agent.confinement.part_limits import AGENT_OOM_SCORE_ADJ, WORKER_OOM_SCORE_ADJ, disk_used
from node_agent.part.attempt import Part
from node_agent.part.commands import AttemptPaths
from tests.helpers import need
from tests.node_agent.helpers import Launcher, make_spec, wait_finished, wait_for
from trainyard.protocol.agent import NodeAttemptState

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="cgroup limits, tmpfs mounts and uids need root")
UID = 20170  # the tests' own corner of the dev pool (trainyard.dev.DEV_WORKER_UIDS), beside test_isolation's
NODE = NodeResources(memory=66 * GiB, cpus=32, gpus=8, work_dir_space=1000 * GiB)


# --- the policy ---


def test_sizes_parse_and_print() -> None:
    assert parse_size("48G") == 48 * GiB and parse_size("512m") == 512 * MiB and parse_size("1.5GiB") == GiB * 3 // 2
    assert parse_size("4096") == 4096 and parse_size("2 T") == 2 * 1024 * GiB
    for bad in ("", "G", "-1G", "0", "12Q", "1e9"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert format_size(48 * GiB) == "48 GiB" and format_size(1536 * MiB) == "1.5 GiB" and format_size(10) == "10 B"


def test_a_part_gets_its_gpu_share_of_the_node_less_the_reserve() -> None:
    two = part_limits(NODE, 2, LimitOptions())
    assert two.memory == (66 - 2) * GiB // 4 and two.cpu_weight == 200 and two.cpus is None and two.pids == 8192
    assert two.shm == two.memory // 2 and two.work_dir == 250 * GiB
    whole = part_limits(NODE, 8, LimitOptions(reserve=10 * GiB))
    assert whole.memory == 56 * GiB and whole.cpu_weight == 800
    # A CPU-only node (virtual slots, no GPU found): the whole node less the reserve.
    assert part_limits(NodeResources(memory=8 * GiB, cpus=2, gpus=0, work_dir_space=GiB), 1,
                       LimitOptions()).memory == 6 * GiB
    # The reserve never takes more than half a small node.
    assert part_limits(NodeResources(memory=2 * GiB, cpus=2, gpus=1, work_dir_space=GiB), 1,
                       LimitOptions()).memory == GiB


def test_operators_override_each_limit_and_can_turn_them_off() -> None:
    options = limit_options(memory="48G", pids=100, cpus=1.5, shm="1G", work_dir="10G", reserve="0")
    assert part_limits(NODE, 1, options) == PartLimits(memory=48 * GiB, pids=100, cpus=1.5, cpu_weight=100,
                                                       shm=GiB, work_dir=10 * GiB)
    assert part_limits(NODE, 4, LimitOptions(enabled=False)) == PartLimits()
    with pytest.raises(ValueError):
        LimitOptions(pids=0)
    with pytest.raises(ValueError):
        limit_options(memory="lots")


@pytest.mark.usefixtures("keep_logging")
def test_the_agent_command_line_takes_the_limit_options(tmp_path: Path) -> None:
    """``trainyard agent`` and ``python -m node_agent`` parse with one table (node_agent/options.py;
    tests/node_agent/test_command_line.py compares them)."""
    from node_agent.options import build_parser, parse_args

    names = {"--part-memory-limit", "--memory-reserve", "--part-pids-max", "--part-cpus", "--part-shm-size",
             "--part-work-dir-size", "--no-part-limits", "--part-limits"}
    table = {o for action in build_parser()._actions for o in action.option_strings}
    assert names <= table, names - table
    token = tmp_path / "token"
    token.write_text("t\n")
    parsed = parse_args(["--control-plane", "http://127.0.0.1:1", "--name", "n", "--address", "127.0.0.1",
                         "--join-token-file", str(token), "--work-dir", str(tmp_path), "--part-memory-limit", "48G",
                         "--part-pids-max", "512", "--part-cpus", "2.5", "--memory-reserve", "0"])
    assert parsed.limits == LimitOptions(memory=48 * GiB, pids=512, cpus=2.5, reserve=0)
    off = parse_args(["--control-plane", "http://127.0.0.1:1", "--name", "n", "--address", "127.0.0.1",
                      "--join-token-file", str(token), "--work-dir", str(tmp_path), "--no-part-limits"])
    assert not off.limits.enabled


def test_a_limit_hit_is_named_in_the_reason() -> None:
    limits = PartLimits(memory=48 * GiB, pids=4096)
    assert limit_reason(limits, LimitEvents()) is None
    assert (limit_reason(limits, LimitEvents(oom_kills=1)) or "").startswith("out of memory: cgroup limit 48 GiB")
    assert (limit_reason(limits, LimitEvents(pids_max_hits=3)) or "").startswith("process limit: pids.max 4096 reached")


def test_cgroup_v1_hierarchies_are_found_in_mountinfo() -> None:
    mountinfo = ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
                 "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                 "39 31 0:36 /outer /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
                 "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    own = "2:cpu,cpuacct:/a\n4:memory:/sandbox/x\n8:pids:/outer/y\n0::/\n"
    assert cgroup1_dirs(mountinfo, own) == {"cpu": Path("/sys/fs/cgroup/cpu,cpuacct/a"),
                                            "memory": Path("/sys/fs/cgroup/memory/sandbox/x"),
                                            "pids": Path("/sys/fs/cgroup/pids/y")}
    assert cgroup1_dirs(mountinfo, "0::/\n") == {}


def test_limits_are_written_read_back_and_kept_for_an_adopting_agent(tmp_path: Path) -> None:
    """The files a cgroup v2 and a v1 hierarchy take, on plain directories; the state a restarted
    agent reads back; and the wrapper's arguments."""
    v2 = LimitGroups(tuple((c, tmp_path) for c in ("memory", "pids", "cpu")), 2)
    v2.apply(48 * GiB, 4096, 1.5, 200)
    assert (tmp_path / "memory.max").read_text() == str(48 * GiB) and (tmp_path / "pids.max").read_text() == "4096"
    assert (tmp_path / "cpu.max").read_text() == "150000 100000" and v2.joins() == []
    assert (tmp_path / "cpu.weight").read_text() == "200"
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\n")
    (tmp_path / "pids.events").write_text("max 12\n")
    assert v2.counters() == (1, 12)
    mem, pids, cpu = tmp_path / "mem", tmp_path / "pids", tmp_path / "cpu"
    for directory in (mem, pids, cpu):
        directory.mkdir()
    v1 = LimitGroups((("memory", mem), ("pids", pids), ("cpu", cpu)), 1)
    v1.apply(GiB, 64, None, 300)
    assert (mem / "memory.limit_in_bytes").read_text() == str(GiB) and v1.joins() == [mem, pids, cpu]
    assert (cpu / "cpu.shares").read_text() == "3072" and not (cpu / "cpu.cfs_quota_us").exists()
    confinement = Confinement(uid=UID, gid=UID, limits=PartLimits(memory=GiB, pids=64), limit_groups=v1,
                              shm_dir=tmp_path / "shm", oom_score_adj=WORKER_OOM_SCORE_ADJ)
    again = Confinement.from_state(confinement.to_state())
    assert (again.limits, again.limit_groups, again.shm_dir) == (confinement.limits, v1, tmp_path / "shm")
    command = " ".join(confinement.wrap(["train"]))
    assert f"--cgroup {mem} --cgroup {pids} --cgroup {cpu} --oom-score-adj 500 --shm {tmp_path / 'shm'}" in command
    assert Confinement.from_state({"limits": "x", "limit_groups": {"version": 3}}).limits is None


def test_a_cgroup_v2_holding_processes_moves_them_to_a_leaf_to_delegate(tmp_path: Path) -> None:
    """On plain files: an empty cgroup moves nothing; one whose processes did not move says so (a
    real cgroup.procs moves a pid on write; this machine's v2 offers no controller to try it on)."""
    (tmp_path / "cgroup.procs").write_text("")
    assert _move_to_leaf(tmp_path) is None and (tmp_path / AGENT_LEAF).is_dir()
    (tmp_path / "cgroup.procs").write_text("4242\n")
    assert "still holds processes" in (_move_to_leaf(tmp_path) or "")
    assert (tmp_path / AGENT_LEAF / "cgroup.procs").read_text() == "4242"


def test_the_work_dir_measure_counts_blocks_and_stops_early(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_bytes(os.urandom(MiB))
    (tmp_path / "link").symlink_to("/usr")  # never followed
    used, entries = disk_used(tmp_path, 100 * MiB)
    assert MiB <= used < 2 * MiB and entries == 3
    assert disk_used(tmp_path, 0)[0] > 0


# --- real parts under their limits ---


@pytest.fixture
def oom_adj_restored() -> Iterator[None]:
    """Isolation.configure makes its process (here the test's) the OOM killer's last choice."""
    before = Path("/proc/self/oom_score_adj").read_text().strip()
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            Path("/proc/self/oom_score_adj").write_text(before)


@pytest.fixture
def sandbox() -> Iterator[Path]:
    """A directory every worker uid can get through (the test's tmp_path is 0700), removed after."""
    path = Path(tempfile.mkdtemp(prefix="trainyard-limits-"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside every part: it must outlive each attack."""
    proc = subprocess.Popen(["/bin/sleep", "600"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def _attack(sandbox: Path, launcher: Launcher, script: str, options: LimitOptions) -> Part:
    """Run ``script`` as a one-rank part of an agent configured with ``options``, confined as the
    agent confines parts, and wait until the part is over."""
    code = sandbox / "code"
    code.mkdir(mode=0o755)
    (code / "train.py").write_text(script)
    (code / "train.py").chmod(0o644)
    isolation, notes = Isolation.configure(UidRange(UID, UID + 3), sandbox / "run", use_cgroups=True,
                                           cwd=str(code), limits=options, gpus=1, work_dir=sandbox)
    assert isolation.limiter is not None, notes
    # Runs here and in CI (root, hybrid cgroups); elsewhere it skips, saying why (CI fails instead).
    need(isolation.limiter.tree is not None, f"no cgroup limits on this machine: {notes}")
    # Lowering it takes CAP_SYS_RESOURCE, which some containers (this one) drop: then the log says so.
    refused = f"cannot set the agent's oom_score_adj to {AGENT_OOM_SCORE_ADJ}"
    assert (Path("/proc/self/oom_score_adj").read_text().strip() == str(AGENT_OOM_SCORE_ADJ)
            or any(n.startswith(refused) for n in notes)), notes
    spec = make_spec(nproc_per_node=1, gpu_indices=[0])
    confinement = isolation.confine("limits-test", spec.attempt_id, spec.node_rank, lambda: set(), gpus=1)
    workers = sandbox / "workers"
    workers.mkdir(mode=0o711, exist_ok=True)
    paths = AttemptPaths(sandbox / "attempts" / spec.attempt_id, workers / spec.attempt_id)
    run = Part.launch(spec, launcher.node(cwd=str(code)), paths, stop_grace_s=2.0, confinement=confinement)
    launcher.runs.append(run)
    try:
        wait_finished(run, timeout=240)  # a fork bomb slows every scan of the process table meanwhile
    finally:
        run.kill_now()
        wait_for(lambda: not (confinement.cgroup and confinement.cgroup.pids()), 20, what="the part's processes")
        isolation.release(confinement)
    assert confinement.shm_dir is None or not confinement.shm_dir.exists()
    return run


def _failed_with(run: Part, reason: str, bystander: subprocess.Popen[bytes]) -> None:
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and (report.error or "").startswith(reason), report.error
    assert run.limit_hit == report.error
    assert bystander.poll() is None and os.getppid() > 0  # the test (the agent here) and its neighbour live


@root_only
def test_a_workers_oom_score_adj_makes_it_the_first_choice(sandbox: Path) -> None:
    confinement = Confinement(uid=UID, gid=UID, oom_score_adj=WORKER_OOM_SCORE_ADJ, expose=worker_paths(os.getcwd()))
    done = subprocess.run(confinement.wrap([sys.executable, "-I", "-S", "-c",
                                            "import os; print(open('/proc/self/oom_score_adj').read(), os.getuid())"]),
                          capture_output=True, text=True, timeout=60, check=False, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(WORKER_OOM_SCORE_ADJ), str(UID)]


@root_only
def test_a_memory_hog_is_killed_at_its_cgroup_limit(sandbox: Path, launcher: Launcher, oom_adj_restored: None,
                                                     bystander: subprocess.Popen[bytes]) -> None:
    script = ("import time\nheld = []\n"
              "while True:\n    held.append(bytearray(64 << 20))\n    time.sleep(0.01)\n")
    run = _attack(sandbox, launcher, script, LimitOptions(memory=1536 * MiB))
    _failed_with(run, "out of memory: cgroup limit 1.5 GiB", bystander)


@root_only
def test_a_fork_bomb_is_held_at_pids_max_and_stopped(sandbox: Path, launcher: Launcher, oom_adj_restored: None,
                                                      bystander: subprocess.Popen[bytes]) -> None:
    script = ("import os, time\n"
              "while True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.001)\n")
    run = _attack(sandbox, launcher, script, LimitOptions(pids=256))
    _failed_with(run, "process limit: pids.max 256 reached", bystander)


@root_only
def test_a_dev_shm_filler_is_stopped_at_its_cap(sandbox: Path, launcher: Launcher, oom_adj_restored: None,
                                                bystander: subprocess.Popen[bytes]) -> None:
    name = f"trainyard-filler-{os.getpid()}"
    script = ("import time\nwritten = 0\n"
              f"with open('/dev/shm/{name}', 'wb') as f:\n"
              "    try:\n        while True:\n            f.write(bytes(1 << 20)); f.flush(); written += 1\n"
              "    except OSError as exc:\n        print('stopped after', written, 'MiB:', exc, flush=True)\n"
              "time.sleep(600)\n")
    host_free = shutil.disk_usage("/dev/shm").free
    run = _attack(sandbox, launcher, script, LimitOptions(shm=64 * MiB))
    _failed_with(run, "shared memory limit: /dev/shm of the part is full at its 64 MiB cap", bystander)
    assert not Path(f"/dev/shm/{name}").exists()  # the host's /dev/shm never saw it
    assert shutil.disk_usage("/dev/shm").free > host_free - 32 * MiB


@root_only
def test_a_work_dir_filler_is_stopped_at_its_cap(sandbox: Path, launcher: Launcher, oom_adj_restored: None,
                                                 bystander: subprocess.Popen[bytes]) -> None:
    script = ("import os, time\n"
              "with open(os.path.join(os.environ['TMPDIR'], 'fill'), 'wb') as f:\n"
              "    for _ in range(2048):\n        f.write(os.urandom(1 << 20)); f.flush(); time.sleep(0.002)\n"
              "time.sleep(600)\n")
    run = _attack(sandbox, launcher, script, LimitOptions(work_dir=64 * MiB))
    _failed_with(run, "disk limit: the part's work directory holds", bystander)
    assert "over its 64 MiB cap" in (run.error or "")
    assert not (run.paths.worker / "tmp" / "fill").exists() or (run.paths.worker / "tmp" / "fill").stat().st_size < GiB



@root_only
def test_a_rank_started_in_a_warm_standby_is_under_its_parts_limits(tmp_path: Path, oom_adj_restored: None) -> None:
    """A standby was started by the agent (its cgroups, its oom_score_adj): the rank it becomes
    takes on the claimant's limit cgroups and oom_score_adj, as a cold start has them."""
    from tests.node_agent.test_standby import record, run_shim, start_standby

    isolation, notes = Isolation.configure(None, tmp_path / "run", use_cgroups=True, cwd=os.getcwd(),
                                           limits=LimitOptions(pids=300), gpus=1, work_dir=tmp_path)
    assert isolation.limiter is not None and isolation.cgroups is not None, notes
    need(isolation.limiter.tree is not None, f"no cgroup limits on this machine: {notes}")
    confinement = isolation.confine("standby-limits", f"att-{os.getpid()}", 0, lambda: set(), gpus=1)
    assert confinement.cgroup is not None and confinement.limit_groups is not None
    spawned: list[subprocess.Popen[bytes]] = []
    work = Path("/tmp") / f"standby-limits-{os.getpid()}"
    try:
        work.mkdir(mode=0o755)
        for name in ("standbys", "status", "logs"):
            (work / name).mkdir(mode=0o755)
        start_standby(spawned, work / "standbys", "c", "--cgroup-base", str(isolation.cgroups.base))
        (work / "who.py").write_text(
            "import json\n"
            "print(json.dumps({'adj': open('/proc/self/oom_score_adj').read().strip(),\n"
            " 'cgroups': open('/proc/self/cgroup').read().splitlines()}))\n")
        shim = run_shim(spawned, work, "file", str(work / "who.py"), standbys=work / "standbys",
                        wrap=confinement.wrap(["program"])[:-1])
        assert shim.wait(60) == 0
        assert record(work)["standby"] is True
        seen = json.loads((work / "logs" / "rank-0" / "stdout.log").read_text())
        assert seen["adj"] == str(WORKER_OOM_SCORE_ADJ)
        pids = confinement.limit_groups.path("pids")
        assert pids is not None
        if confinement.limit_groups.version == 1:  # the part's v1 cgroups, not the standby's (the agent's)
            joined = cgroup1_dirs(Path("/proc/self/mountinfo").read_text(), "\n".join(seen["cgroups"]))
            assert joined["pids"] == pids and joined["memory"] == confinement.limit_groups.path("memory")
    finally:
        for proc in spawned:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
        confinement.cgroup.kill()
        wait_for(lambda: not confinement.cgroup.pids(), 10, what="the part's processes")  # type: ignore[union-attr]
        isolation.release(confinement)
        shutil.rmtree(work, ignore_errors=True)
