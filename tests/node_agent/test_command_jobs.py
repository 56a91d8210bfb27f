"""A job's own command in place of torchrun (issue 26 item 7; node_agent/part/commands.py, command_argv):
it runs only through the confine wrapper as the part's uid (nothing of it as root: the kernel's proc
connector records every exec), argv[0] is resolved after the switch (a path relative to the job's
code, a name on the uid's PATH), it gets the environment contract and the job's env, its exit is the
part's, its output the part's log, and a stop ends its whole process tree."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from node_agent.confinement import processes
from node_agent.confinement.isolation import CONFINE_EXEC, Confinement, UidPool, UidRange, worker_paths
from node_agent.part.attempt import Part
from node_agent.part.commands import AttemptPaths, NodeContext, command_argv, command_env
from tests.node_agent.helpers import make_spec, read_log, wait_finished, wait_for
from tests.node_agent.proc_events import ProcRecorder
from trainyard.protocol.agent import NodeAttemptState, WorkerState

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="switching uids (and the proc connector) needs root")
UID = 20150 + 70  # the tests' corner of the dev pool (tests/node_agent/test_isolation.py), its own uid

SCRIPT = """#!/bin/sh
echo "uid $(id -u) node $NODE_RANK of $NNODES x $NPROC_PER_NODE world $TRAINYARD_WORLD_SIZE"
echo "master $MASTER_ADDR:$MASTER_PORT same $TRAINYARD_MASTER_ADDR:$TRAINYARD_MASTER_PORT"
echo "attempt $TRAINYARD_ATTEMPT_ID token $TRAINYARD_FENCING_TOKEN mine $MY_SETTING arg [$1]"
echo "pwd $(pwd)"
echo "to stderr" >&2
exit 3
"""


def _node(cwd: Path) -> NodeContext:
    return NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:9", virtual=True, join_timeout_s=60,
                       shutdown_timeout_s=2, monitor_interval_s=0.2, cwd=str(cwd))


@contextlib.contextmanager
def _confined(locks: Path) -> Iterator[Confinement]:
    lease = UidPool(UidRange(UID, UID), locks).lease(processes.uids_alive)
    assert lease is not None, f"uid {UID} is in use"
    try:
        yield Confinement(uid=lease.uid, gid=lease.gid, lease=lease, expose=worker_paths(os.getcwd()))
    finally:
        lease.close()


def test_the_contract_is_in_the_commands_environment_and_argv_is_left_to_the_uid(tmp_path: Path) -> None:
    spec = make_spec(nnodes=3, node_rank=2, nproc_per_node=4, gpu_indices=[0, 1, 2, 3], rdzv_host="10.0.0.7",
                     rdzv_port=29511, command=["scripts/run.sh", "--flag"])
    node = _node(tmp_path)
    paths = AttemptPaths(tmp_path / "attempt")
    argv = command_argv(spec, node, paths)
    # One rank shim runs the command; a relative argv[0] is made absolute against the code, never opened.
    assert argv[1:6] == ["-m", "node_agent.ranks.shim", "--log-dir", str(paths.log_dir), "command"]
    assert argv[6:] == [str(tmp_path / "scripts/run.sh"), "--flag"]
    bare = command_argv(spec.model_copy(update={"command": ["bash", "x.sh"]}), node, paths)
    assert bare[6:] == ["bash", "x.sh"]  # a name: looked up on PATH by the shim, as the job's uid
    env = command_env(spec, node, paths)
    assert {k: env[k] for k in ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")} == {
        "NODE_RANK": "2", "NNODES": "3", "NPROC_PER_NODE": "4", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29511"}
    assert env["TRAINYARD_WORLD_SIZE"] == "12" and env["TRAINYARD_NODE_RANK"] == "2"
    assert env["TRAINYARD_MASTER_ADDR"] == "10.0.0.7" and env["TRAINYARD_MASTER_PORT"] == "29511"
    assert env["TRAINYARD_FENCING_TOKEN"] == spec.fencing_token and env["TRAINYARD_LOCAL_ADDR"] == "127.0.0.2"
    assert "RANK" not in env and "TRAINYARD_RENDEZVOUS" not in env  # its launcher numbers the ranks


@root_only
def test_a_command_runs_as_the_parts_uid_only_and_its_exit_is_the_parts(tmp_path: Path, open_dir: Path) -> None:
    code = open_dir / "code"
    (code / "scripts").mkdir(parents=True, mode=0o755)
    code.chmod(0o755)
    script = code / "scripts" / "run.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    spec = make_spec(nnodes=2, node_rank=1, nproc_per_node=2, gpu_indices=[0, 1], command=["scripts/run.sh", "a b"],
                     env={"MY_SETTING": "kept"})
    paths = AttemptPaths(tmp_path / "attempt", open_dir / "worker")
    with _confined(tmp_path / "locks") as confinement, ProcRecorder() as recorder:
        run = Part.launch(spec, _node(code), paths, stop_grace_s=2.0, confinement=confinement)
        try:
            wait_finished(run, timeout=30)
        finally:
            run.kill_now()
    assert recorder.lost is None, recorder.lost
    assert run.exit_code == 3, (run.error, paths.torchrun_stderr.read_text())
    out = read_log(run, 2)  # the part's log: the node's first global rank (node rank 1 x 2)
    assert f"uid {UID} node 1 of 2 x 2 world 4" in out
    assert f"master {spec.rdzv_host}:{spec.rdzv_port} same {spec.rdzv_host}:{spec.rdzv_port}" in out
    assert f"attempt {spec.attempt_id} token {spec.fencing_token} mine kept arg [a b]" in out
    assert "to stderr" in read_log(run, 2, "stderr")
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and report.exit_code == 3
    [worker] = report.workers  # the part as one worker: the control plane checks it as this node's block
    assert (worker.rank, worker.local_rank, worker.state, worker.exit_code) == (2, 0, WorkerState.exited, 3)
    # Nothing of the command ran as root: uid 0 ran the agent's confine wrapper alone.
    assert recorder.root_execs_not_wrappers(CONFINE_EXEC) == []
    assert {e.uid for e in recorder.execs} == {0, UID}
    said = [" ".join(e.cmdline) for e in recorder.execs if e.uid == UID and e.cmdline]
    assert any("scripts/run.sh" in line for line in said), said


@root_only
def test_a_stop_ends_the_commands_whole_tree_and_an_unknown_program_fails_the_part(
        tmp_path: Path, open_dir: Path) -> None:
    # A launcher that starts children of its own in their own sessions (as torchrun does its ranks).
    spec = make_spec(nproc_per_node=1, gpu_indices=[0], command=[
        "sh", "-c", "setsid sleep 300 & setsid sleep 301 & echo started; wait"])
    paths = AttemptPaths(tmp_path / "attempt", open_dir / "worker")
    with _confined(tmp_path / "locks") as confinement:
        run = Part.launch(spec, _node(open_dir), paths, stop_grace_s=1.0, confinement=confinement)
        try:
            wait_for(lambda: "started" in read_log(run, 0) if (paths.log_dir / "rank-0").exists() else False,
                     timeout=20, interval=0.05, what="the command's output")
            wait_for(lambda: len(processes.scan().by_uid.get(UID, ())) >= 4, timeout=10, interval=0.05,
                     what="shim, shell and both sleeps")
            run.poll()
            assert run.report(None, None).state == NodeAttemptState.running
            run.request_stop("test")
            wait_finished(run, timeout=20)
        finally:
            run.kill_now()
        assert run.stopped and run.report(None, None).state == NodeAttemptState.stopped
        assert not processes.scan().by_uid.get(UID)  # the setsid'd children too

        missing = make_spec(nproc_per_node=1, gpu_indices=[0], command=["no-such-launcher", "x"])
        paths = AttemptPaths(tmp_path / "attempt2", open_dir / "worker2")
        run = Part.launch(missing, _node(open_dir), paths, stop_grace_s=1.0, confinement=confinement)
        try:
            wait_finished(run, timeout=20)
        finally:
            run.kill_now()
    assert run.exit_code == 127
    assert "cannot start 'no-such-launcher'" in read_log(run, 0, "stderr")
    report = run.report(None, None)
    assert report.state == NodeAttemptState.exited and report.workers[0].exit_code == 127
