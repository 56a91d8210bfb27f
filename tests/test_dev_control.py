"""``trainyard dev up`` keeps running when a node's agent dies, reports it, and acts on a node when
asked (``trainyard dev node kill|kill-workers|restart``, through its data dir). The cluster's
processes here are stand-ins (sleeping Pythons) for the agent and the control plane: what is
tested is the watch loop and the control channel, with real processes and signals."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from node_agent.ranks.entry_points import RANK_SHIM, names
from tests.helpers import ProcessReaper, wait_for
from trainyard.cli import main
from trainyard.dev import DevCluster, DevConfig
from trainyard.dev.control import ControlError, ask
from trainyard.dev.processes import Child, stop_children

SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def _child(reaper: ProcessReaper, name: str, logs: Path, args: list[str] = SLEEPER) -> Child:
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - closed by the cluster
    return Child(name, reaper.spawn(args, stdout=log, stderr=subprocess.STDOUT), logs / f"{name}.log", log)


def test_a_dead_agent_is_reported_and_nodes_are_killed_and_restarted_on_request(tmp_path, process_reaper,
                                                                               capsys):
    config = DevConfig(nodes=2, data_dir=tmp_path, python=sys.executable)
    out = io.StringIO()
    cluster = DevCluster(config, out)
    cluster.logs_dir.mkdir(parents=True)
    # node-1's "agent" runs two "rank shims" (named so: one by the shim's module name, one by its
    # earlier name, as an earlier agent's workers are) with a worker under each: what kill-workers ends.
    shim = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
            " time.sleep(300)")
    agent_with_worker = [sys.executable, "-c", "import subprocess, sys, time; "
                         f"[subprocess.Popen([sys.executable, '-c', {shim!r}, name]) for name in {names(RANK_SHIM)!r}];"
                         " time.sleep(300)"]
    cluster.control_planes = [_child(process_reaper, "control-plane", cluster.logs_dir)]
    cluster.agents = [_child(process_reaper, "node-1", cluster.logs_dir, agent_with_worker),
                      _child(process_reaper, "node-2", cluster.logs_dir)]
    (tmp_path / "dev-up.lock").write_text(str(os.getpid()))
    code: list[int] = []
    watcher = threading.Thread(target=lambda: code.append(cluster.watch(interval=0.05)), daemon=True)
    watcher.start()
    try:
        cluster.agents[1].proc.kill()
        wait_for(lambda: "keeps running without node-2" in out.getvalue(), 10)
        assert watcher.is_alive() and not code

        import psutil

        wait_for(lambda: len(psutil.Process(cluster.agents[0].proc.pid).children(recursive=True)) == 4, 10)
        assert "killed 2 training process" in ask(tmp_path, "kill-workers", "node-1", timeout_s=10)
        assert cluster.agents[0].proc.poll() is None  # the agent lives on
        assert "killed its agent" in ask(tmp_path, "kill", "node-1", timeout_s=10)
        assert cluster.agents[0].proc.wait(10) is not None
        with pytest.raises(ControlError, match="no node 'node-9'"):
            ask(tmp_path, "kill", "node-9", timeout_s=10)
        with pytest.raises(ControlError, match="runs no training process"):
            ask(tmp_path, "kill-workers", "node-2", timeout_s=10)
        # The CLI says the same in one line.
        with pytest.raises(SystemExit) as done:
            main(["dev", "node", "restart", "node-9", "--data-dir", str(tmp_path)])
        assert done.value.code == 1 and "no node 'node-9'" in capsys.readouterr().err
        # Restart starts the real agent command on the node's work dir (it cannot register here: no
        # control plane; it is ended at teardown).
        assert "agent started again" in ask(tmp_path, "restart", "node-2", timeout_s=10)
        process_reaper.add(cluster.agents[1].proc)
        assert cluster.agents[1].proc.args[1:4] == ["-m", "trainyard", "agent"]
        assert watcher.is_alive()
    finally:
        cluster.request_stop()
        watcher.join(10)
    assert code == [0]


def test_asking_without_a_running_dev_up_is_one_line(tmp_path):
    with pytest.raises(ControlError, match="no 'trainyard dev up' runs on"):
        ask(tmp_path, "kill", "node-1", timeout_s=1)


def test_stopping_children_ends_them_and_what_left_their_group(tmp_path, process_reaper):
    """dev up's stop (Ctrl-C, the demo's end, a test's teardown) ends each child's group and the
    descendants that started a session of their own, as an agent's torchrun does."""
    pid_file = tmp_path / "stray.pid"
    stray = (f"import subprocess, sys, time; p = subprocess.Popen({SLEEPER!r}, start_new_session=True);"
             f" open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    child = _child(process_reaper, "node-1", tmp_path, [sys.executable, "-c", stray])
    wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30, what="the stray's pid")
    stray_proc = psutil.Process(int(pid_file.read_text()))
    stop_children([child], 5)
    assert child.proc.poll() is not None
    wait_for(lambda: not stray_proc.is_running() or stray_proc.status() == psutil.STATUS_ZOMBIE, 10,
             what="the stray to end")
