"""Real torchrun launches: one node, two "nodes" on two loopback addresses, failures and stops."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from node_agent.confinement import processes
from node_agent.part.attempt import Part
from node_agent.part.commands import (
    AttemptPaths,
    NodeContext,
    entrypoint_kind,
    storage_env,
    torchrun_command,
    worker_env,
)
from tests.node_agent.helpers import Launcher, make_spec, read_log, wait_finished, wait_for, write_script
from trainyard.protocol.agent import NodeAttemptState, WorkerState
from trainyard.protocol.layout import Layout

ALL_REDUCE = """
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": rank, "world": world, "sum": t.item(), "args": sys.argv[1:],
                  "master": os.environ["MASTER_ADDR"], "node_rank": os.environ["TRAINYARD_NODE_RANK"],
                  "local_rank": int(os.environ["LOCAL_RANK"]), "group_rank": int(os.environ["GROUP_RANK"]),
                  "device": os.environ["TRAINYARD_DEVICE"], "cuda": os.environ["CUDA_VISIBLE_DEVICES"]}))
print(f"rank {rank} stderr", file=sys.stderr)
dist.destroy_process_group()
"""

SLEEPER = """
import os, signal, subprocess, sys, time
if "--ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if "--detach" in sys.argv:
    code = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += "open(os.path.join(os.environ['MARK_DIR'], f'grandchild-{os.getpid()}'), 'w').close(); time.sleep(120)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
time.sleep(120)
"""


def test_entrypoint_kind() -> None:
    assert entrypoint_kind("train.py") == "file"
    assert entrypoint_kind("scripts/train") == "file"
    assert entrypoint_kind("worker_runtime.examples.tiny_gpt") == "module"


def test_command_line(tmp_path: Path) -> None:
    node = NodeContext(local_addr="127.0.0.3", agent_url="http://127.0.0.3:5000", virtual=True, cwd="/src")
    spec = make_spec(node_rank=1, nnodes=2, rdzv_port=29999, entrypoint="train.py", args=["--lr", "1"])
    paths = AttemptPaths(tmp_path)
    cmd = torchrun_command(spec, node, paths)
    # torchrun through the agent's entry: node rank 1 waits for node rank 0's store to listen first.
    assert cmd[1:7] == ["-m", "node_agent.ranks.torchrun_entry", "--wait-for", "127.0.0.2:29999", "--wait-s", "300"]
    assert cmd[7] == "--"
    joined = " ".join(cmd)
    assert "--nnodes 2 --nproc-per-node 2 --node-rank 1 --rdzv-backend static" in joined
    assert f"--rdzv-endpoint 127.0.0.2:29999 --rdzv-id {spec.attempt_id}" in joined
    assert "--rdzv-conf timeout=300 --local-addr 127.0.0.3 --max-restarts 0" in joined
    assert cmd[cmd.index("node_agent.ranks.shim") :] == [
        "node_agent.ranks.shim",
        "--log-dir",
        str(tmp_path / "worker" / "logs"),
        "file",
        "/src/train.py",
        "--lr",
        "1",
    ]
    host_cmd = torchrun_command(make_spec(node_rank=0, nnodes=2, entrypoint="pkg.mod"), node, paths)
    assert host_cmd[host_cmd.index("--node-rank") + 1] == "0"
    assert host_cmd[1:4] == ["-m", "node_agent.ranks.torchrun_entry", "--"]  # the host waits for nobody
    assert host_cmd[-2:] == ["module", "pkg.mod"]


def test_worker_env(tmp_path: Path) -> None:
    """Finding 11: torchrun's environment is an allow-list of the agent's plus the platform's; the
    job's env reaches only the training process (through the rank shim), never torchrun."""
    base = {"PATH": "/bin", "TRAINYARD_JOIN_TOKEN": "secret", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
            "AWS_SECRET_ACCESS_KEY": "agent-secret", "LD_PRELOAD": "/agent.so", "PYTHONPATH": "/agent-lib",
            "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "NCCL_DEBUG": "INFO", "SITE_SETTING": "x"}
    job_env = {"FOO": "bar", "OMP_NUM_THREADS": "4", "PYTHONPATH": "/job-lib"}
    spec = make_spec(gpu_indices=[2, 3], env=job_env, restore_from=None)
    paths = AttemptPaths(tmp_path, tmp_path / "w", tmp_path / "a.sock")
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://a:1", virtual=True, base_env=base,
                       python="/opt/py/bin/python")
    virtual = worker_env(spec, node, paths, uid=20001)
    for name in ("TRAINYARD_JOIN_TOKEN", "AWS_SECRET_ACCESS_KEY", "LD_PRELOAD", "SITE_SETTING", "FOO"):
        assert name not in virtual, name  # neither the agent's own variables nor the job's
    assert json.loads(virtual["TRAINYARD_JOB_ENV"]) == job_env  # for the shim, for the training process
    assert virtual["PATH"] == "/opt/py/bin:/bin"
    assert virtual["PYTHONPATH"].split(":")[-1] == "/agent-lib" and "/job-lib" not in virtual["PYTHONPATH"]
    assert virtual["LANG"] == virtual["LC_ALL"] == "C.UTF-8" and virtual["NCCL_DEBUG"] == "INFO"
    assert virtual["HOME"] == str(tmp_path / "w" / "home") and virtual["TMPDIR"] == str(tmp_path / "w" / "tmp")
    assert virtual["USER"] == virtual["LOGNAME"] == "trainyard-20001"
    assert virtual["OMP_NUM_THREADS"] == "1"  # the platform's default; the job's 4 comes through the shim
    assert virtual["CUDA_VISIBLE_DEVICES"] == "" and virtual["TRAINYARD_DEVICE"] == "cpu"
    assert virtual["TRAINYARD_FENCING_TOKEN"] == spec.fencing_token
    assert virtual["GLOO_SOCKET_IFNAME"] == "lo"
    assert virtual["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert json.loads(virtual["TRAINYARD_CHECKPOINT"]) == {"every_steps": 10}
    assert json.loads(virtual["TRAINYARD_RESTORE_FROM"]) is None
    assert virtual["TRAINYARD_STATUS_DIR"] == str(tmp_path / "w" / "status")
    assert virtual["TRAINYARD_AGENT_URL"] == "http://a:1"
    assert virtual["TRAINYARD_AGENT_SOCKET"] == str(tmp_path / "a.sock")
    assert virtual["TRAINYARD_ATTEMPT_ID"] == spec.attempt_id
    assert virtual["TRAINYARD_NODE_RANK"] == "0" and virtual["TRAINYARD_ATTEMPT_NUMBER"] == "1"
    assert "TRAINYARD_LAYOUT" not in virtual  # no layout: plain DDP
    fsdp = Layout(kind="fsdp", grad_accum_steps=4)
    layered = worker_env(make_spec(layout=fsdp), NodeContext(local_addr="127.0.0.2", agent_url="http://a:1",
                                                            virtual=True, base_env=base), paths)
    assert Layout.model_validate_json(layered["TRAINYARD_LAYOUT"]) == fsdp
    more = NodeContext(local_addr="10.1.2.3", agent_url="http://a:1", virtual=False, base_env=base,
                       env_passthrough=("SITE_SETTING",))
    gpu = worker_env(spec, more, paths)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "2,3" and gpu["TRAINYARD_DEVICE"] == "cuda"
    assert gpu["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert gpu["SITE_SETTING"] == "x"  # an operator's addition to the allow-list
    assert "GLOO_SOCKET_IFNAME" not in gpu and "USER" not in gpu
    assert not any(k.startswith("TRAINYARD_S3_") for k in gpu)  # no storage in the spec
    with pytest.raises(ValueError, match="TRAINYARD_"):
        NodeContext(local_addr="a", agent_url="b", virtual=True, env_passthrough=("TRAINYARD_JOIN_TOKEN",))


def test_storage_env_never_passes_a_credential(tmp_path: Path) -> None:
    """Issue 11, finding 3: workers reach storage through presigned URLs; whatever a control plane
    puts in LaunchSpec.storage (an old one sent the root keys), no credential reaches a worker."""
    storage = {"endpoint": "s3:9000", "bucket": "b", "access_key": "ak", "secret_key": "sk", "secure": False,
               "region": "r", "prefix": "jobs/j/checkpoints", "access": "presigned", "other": "ignored"}
    assert storage_env(storage) == {
        "TRAINYARD_STORAGE_ACCESS": "presigned", "TRAINYARD_CHECKPOINT_PREFIX": "jobs/j/checkpoints",
    }
    assert storage_env({"access": "presigned", "prefix": None}) == {"TRAINYARD_STORAGE_ACCESS": "presigned"}
    assert storage_env({}) == {}
    base = {"TRAINYARD_S3_SECRET_KEY": "the-agent's", "TRAINYARD_CHECKPOINT_PREFIX": "x"}
    spec = make_spec(storage=storage)
    env = worker_env(spec, NodeContext(local_addr="127.0.0.2", agent_url="http://a:1", virtual=True, base_env=base),
                     AttemptPaths(tmp_path))
    assert env["TRAINYARD_CHECKPOINT_PREFIX"] == "jobs/j/checkpoints"
    assert "sk" not in env.values() and "the-agent's" not in env.values()
    assert not any(k.startswith("TRAINYARD_S3_") for k in env)


def _check_ranks(runs: list[Part], world: int) -> None:
    seen = {}
    for run in runs:
        report = run.report(None, None)
        assert report.state == NodeAttemptState.exited, run.paths.torchrun_stderr.read_text()
        assert report.exit_code == 0
        assert len(report.workers) == run.spec.nproc_per_node
        for worker in report.workers:
            assert worker.state == WorkerState.exited and worker.exit_code == 0
            assert worker.pid is not None and worker.ended_at is not None
            out = json.loads(read_log(run, worker.rank).strip())
            assert read_log(run, worker.rank, "stderr") == f"rank {worker.rank} stderr\n"
            assert out["rank"] == worker.rank and out["world"] == world
            assert out["sum"] == world * (world + 1) / 2
            assert out["node_rank"] == str(run.spec.node_rank)
            # torchrun's node order is the control plane's, and a node's ranks are contiguous.
            assert out["group_rank"] == run.spec.node_rank
            assert worker.rank == run.spec.node_rank * run.spec.nproc_per_node + out["local_rank"]
            assert out["device"] == "cpu" and out["cuda"] == ""
            seen[worker.rank] = out
    assert sorted(seen) == list(range(world))


def test_single_node_all_reduce(launcher: Launcher, tmp_path: Path) -> None:
    write_script(tmp_path, "train.py", ALL_REDUCE)
    run = launcher.launch(make_spec(entrypoint="train.py", args=["--x", "1"]))
    wait_finished(run)
    _check_ranks([run], world=2)
    assert json.loads(read_log(run, 0))["args"] == ["--x", "1"]
    state = json.loads(run.paths.state_file.read_text())
    assert state["pid"] == run.pid and state["pgid"] == run.pgid and state["torchrun_done"]
    assert state["spec"]["attempt_id"] == run.attempt_id


def test_two_nodes_on_two_loopback_addresses(launcher: Launcher, tmp_path: Path) -> None:
    """Two torchruns, as two nodes 127.0.0.3 (node rank 0, rendezvous host) and 127.0.0.2, form one
    world of 4 ranks and gloo, numbered in the control plane's node order (a c10d rendezvous would
    sort them by address and put 127.0.0.2 first)."""
    write_script(tmp_path, "train.py", ALL_REDUCE)
    shared = make_spec(nnodes=2, rdzv_host="127.0.0.3", entrypoint="train.py")
    # The second node starts first: it must wait for the host rather than become one.
    second = launcher.launch(shared.model_copy(update={"node_rank": 1}), launcher.node("127.0.0.2"))
    time.sleep(0.5)
    first = launcher.launch(shared, launcher.node("127.0.0.3"))
    wait_finished(first, timeout=60)
    wait_finished(second, timeout=60)
    _check_ranks([first, second], world=4)
    masters = {
        json.loads(read_log(run, w.rank))["master"] for run in (first, second) for w in run.report(None, None).workers
    }
    assert masters == {"127.0.0.3"}  # global rank 0 is on node rank 0
    # The early node waited for the host's port itself (refused while the host was not yet up), so
    # its TCPStore connected at once rather than at a step of torch's connect backoff.
    waited = re.search(r"rendezvous host 127\.0\.0\.3:\d+ accepted after (\d+) refused tries",
                       second.paths.torchrun_stderr.read_text())
    assert waited is not None and int(waited.group(1)) >= 1
    assert "rendezvous host" not in first.paths.torchrun_stderr.read_text()


FENCED_ALL_REDUCE = """
import json, os
import torch
import torch.distributed as dist
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import init_distributed
ctx = WorkerContext.from_env()
init_distributed(ctx, timeout=60)
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": rank, "world": world, "sum": t.item(), "env_rank": int(os.environ["RANK"]),
                  "node_rank": ctx.node_rank, "local_rank": ctx.local_rank,
                  "rendezvous": [ctx.rendezvous.host, ctx.rendezvous.port]}))
dist.destroy_process_group()
"""


def test_a_restartable_attempt_runs_torchrun_per_node_and_joins_the_fenced_rendezvous(
        launcher: Launcher, tmp_path: Path) -> None:
    """Issue 14 (launch of restartable parts): each node's torchrun is a local supervisor only
    (--standalone, no cross-node store), the rank shim numbers the workers globally in the control
    plane's node order, and they meet at the attempt's fenced rendezvous (its host and port)."""
    write_script(tmp_path, "train.py", FENCED_ALL_REDUCE)
    shared = make_spec(nnodes=2, rdzv_host="127.0.0.3", entrypoint="train.py", restartable=True)
    command = torchrun_command(shared, launcher.node("127.0.0.3"), AttemptPaths(tmp_path))
    assert "--standalone" in command and "--rdzv-endpoint" not in command
    second = launcher.launch(shared.model_copy(update={"node_rank": 1}), launcher.node("127.0.0.2"))
    first = launcher.launch(shared, launcher.node("127.0.0.3"))
    wait_finished(first, timeout=60)
    wait_finished(second, timeout=60)
    seen = {}
    for run in (first, second):
        report = run.report(None, None)
        assert report.exit_code == 0, run.paths.torchrun_stderr.read_text()
        for worker in report.workers:
            out = json.loads(read_log(run, worker.rank).strip())
            assert out["rank"] == out["env_rank"] == worker.rank
            assert worker.rank == run.spec.node_rank * run.spec.nproc_per_node + out["local_rank"]
            assert out["world"] == 4 and out["sum"] == 10
            assert out["rendezvous"] == ["127.0.0.3", shared.rdzv_port]
            seen[worker.rank] = out
    assert sorted(seen) == [0, 1, 2, 3]


def test_failing_rank_exit_code(launcher: Launcher, tmp_path: Path) -> None:
    write_script(
        tmp_path,
        "fail.py",
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n",
    )
    run = launcher.launch(make_spec(entrypoint="fail.py"))
    wait_finished(run)
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited
    assert report.exit_code not in (0, None)
    assert report.error and "torchrun exited" in report.error
    by_rank = {w.rank: w for w in report.workers}
    assert by_rank[1].exit_code == 3
    assert by_rank[0].state == WorkerState.exited  # torchrun tore the healthy rank down


def _attempt_pids(run: Part) -> set[int]:
    return processes.scan().by_attempt.get(run.attempt_id, set())


def _gone(pids: set[int]) -> bool:
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            pass
    return True


def _wait_running(run: Part) -> None:
    def running() -> bool:
        run.poll()
        return run.report(None, None).state == NodeAttemptState.running

    wait_for(running, what="the ranks to run")


def test_stop_kills_every_process_of_the_attempt(launcher: Launcher, tmp_path: Path) -> None:
    """Workers that ignore SIGTERM, and a grandchild in a session of its own, all go."""
    write_script(tmp_path, "sleeper.py", SLEEPER)
    run = launcher.launch(
        make_spec(entrypoint="sleeper.py", args=["--ignore-term", "--detach"], env={"MARK_DIR": str(tmp_path)}),
        grace=1.0,
    )
    _wait_running(run)
    wait_for(lambda: len(list(tmp_path.glob("grandchild-*"))) == 2, what="the detached grandchildren")
    grandchildren = {int(p.name.split("-")[1]) for p in tmp_path.glob("grandchild-*")}
    workers = {w.pid for w in run.report(None, None).workers}
    pids = _attempt_pids(run)
    assert run.pid in pids and workers <= pids and grandchildren <= pids
    assert len(pids) == 7  # torchrun, 2 shims, 2 workers, 2 grandchildren
    started = time.monotonic()
    run.request_stop("test")
    assert run.alive
    wait_finished(run, timeout=10)
    # Nothing here heeds SIGTERM: all went with the SIGKILL after the 1 s grace period.
    assert 0.9 < time.monotonic() - started < 5
    assert _gone(pids)
    report = run.report(None, None)
    assert report.state == NodeAttemptState.stopped
    assert all(w.state == WorkerState.exited for w in report.workers)


TERM_HANDLER = """
import os, signal, time

def stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent's SIGTERM and the shim's forwarded one
    open(os.path.join(os.environ["MARK_DIR"], f"term-{os.environ['RANK']}"), "w").close()
    os._exit(0)

signal.signal(signal.SIGTERM, stop)
open(os.path.join(os.environ["MARK_DIR"], f"ready-{os.environ['RANK']}"), "w").close()
time.sleep(120)
"""


def test_a_stop_kills_torchrun_once_its_workers_are_gone_not_after_its_own_teardown(
        launcher: Launcher, tmp_path: Path) -> None:
    """Issue 14 (decision): the workers of a stopped part get their SIGTERM and their grace, but
    torchrun, whose own teardown after a SIGTERM ends nothing of the job's, is SIGKILLed the moment
    it is the only process left: the part's GPUs are released (and the next attempt placed) that
    much sooner. Before, torchrun exited on its own (code 1, SignalException) about half a second
    after its last worker."""
    write_script(tmp_path, "term.py", TERM_HANDLER)
    run = launcher.launch(make_spec(entrypoint="term.py", env={"MARK_DIR": str(tmp_path)}), grace=600.0)
    _wait_running(run)
    wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="the workers' SIGTERM handlers")
    pids = _attempt_pids(run)
    run.request_stop("test")
    deadline = time.monotonic() + 30
    while run.alive and time.monotonic() < deadline:
        run.poll()
        time.sleep(0.01)
    assert not run.alive and _gone(pids)
    assert sorted(p.name for p in tmp_path.glob("term-*")) == ["term-0", "term-1"]  # each worker's grace
    report = run.report(None, None)
    assert report.state == NodeAttemptState.stopped
    assert [(w.state, w.exit_code) for w in report.workers] == [(WorkerState.exited, 0)] * 2
    assert report.exit_code == -signal.SIGKILL  # torchrun, killed by the agent, not its own exit


def test_a_process_table_older_than_the_workers_never_kills_them_before_their_grace(
        launcher: Launcher, tmp_path: Path) -> None:
    """The supervise step shares one process table among its parts; one scanned before torchrun's
    shims started shows torchrun alone. A stop must not read that as "every worker is gone" and
    SIGKILL the part: each worker still gets its SIGTERM and its grace (here a handler that takes
    half a second)."""
    slow = TERM_HANDLER.replace("    open(os.path", "    time.sleep(0.5)\n    open(os.path", 1)
    write_script(tmp_path, "term.py", slow)
    stale = processes.scan()  # before the launch: no shim, no worker
    run = launcher.launch(make_spec(entrypoint="term.py", env={"MARK_DIR": str(tmp_path)}), grace=600.0)
    _wait_running(run)
    wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="the workers' SIGTERM handlers")
    run.request_stop("test")
    run.poll(stale)
    deadline = time.monotonic() + 30
    while run.alive and time.monotonic() < deadline:
        run.poll()
        time.sleep(0.01)
    assert not run.alive
    assert sorted(p.name for p in tmp_path.glob("term-*")) == ["term-0", "term-1"]  # each worker's grace


def test_torchrun_killed_alone_leaves_nothing(launcher: Launcher, tmp_path: Path) -> None:
    write_script(tmp_path, "sleeper.py", SLEEPER)
    run = launcher.launch(make_spec(entrypoint="sleeper.py"), grace=1.0)
    _wait_running(run)
    pids = _attempt_pids(run)
    assert run.pid is not None
    os.kill(run.pid, signal.SIGKILL)
    wait_finished(run, timeout=10)
    assert _gone(pids)
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and report.exit_code == -signal.SIGKILL


def test_a_launcher_file_a_worker_forged_never_keeps_its_part_from_stopping(launcher: Launcher, tmp_path: Path) -> None:
    """launcher.json (node_agent/ranks/torchrun_entry.py: the pids of a warm torchrun) is written by the
    job's uid, so its bytes are the job's: a nesting that exhausts the JSON parser's recursion must
    not stop the agent's poll (it would leave the part running and fail the agent's adoption)."""
    # Under the 64 KiB a rank file may have, and deep enough to exhaust the parser.
    nested = "import os\nopen(os.path.join(os.environ['TRAINYARD_STATUS_DIR'], 'launcher.json'), 'w')" \
             ".write('[' * 60000)\n"
    write_script(tmp_path, "forger.py", nested + TERM_HANDLER)
    run = launcher.launch(make_spec(entrypoint="forger.py", env={"MARK_DIR": str(tmp_path)}), grace=600.0)
    _wait_running(run)
    wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == 2, what="the workers' SIGTERM handlers")
    run.request_stop("test")
    deadline = time.monotonic() + 30
    while run.alive and time.monotonic() < deadline:
        run.poll()  # never raises
        time.sleep(0.01)
    assert not run.alive
    assert run.report(None, None).exit_code == -signal.SIGKILL  # torchrun killed once its workers were gone
