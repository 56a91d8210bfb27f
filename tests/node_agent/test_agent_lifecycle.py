"""Agent lifecycle faults with real processes (issue 9): launch failures that must be reported, an
agent restarted mid-attempt, a final status that arrives late, process groups whose id was reused."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from node_agent.agent import Agent
from node_agent.part.attempt import Part, attempt_paths
from node_agent.ranks.entry_points import OLD_NAMES, RANK_SHIM, TORCHRUN_ENTRY, started_as
from tests.node_agent.fake_control_plane import FakeControlPlane
from tests.node_agent.helpers import make_spec, wait_for
from tests.node_agent.test_agent import NODE, SLEEPER, Agents, agents, attempt_pids, plane, wait_state  # noqa: F401
from trainyard.dev.processes import is_training
from trainyard.protocol.agent import LaunchSpec, LocalAttempt, NodeAttemptState

__all__ = ["agents", "plane"]


def test_attempt_dir_that_cannot_be_made_is_reported_as_the_parts_failure(
    agents: Agents, plane: FakeControlPlane
) -> None:
    agent = agents.start()
    attempts_dir = agents.tmp_path / "agent" / "attempts"
    shutil.rmtree(attempts_dir)
    attempts_dir.write_text("not a directory")  # mkdir of attempts/<id> fails for real (ENOTDIR)
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited, timeout=15)
    assert final.error is not None and "could not create the attempt directory" in final.error
    assert final.fencing_token == spec.fencing_token
    # Reported once, never launched: the agent keeps no process and forgets it after the ack.
    assert agent.run(spec.attempt_id) is None or not agent.run(spec.attempt_id).alive  # type: ignore[union-attr]


WAIT_THEN_EXIT = """
import os, sys, time
go = sys.argv[1]
print('waiting', flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
sys.exit(int(sys.argv[2]) if int(os.environ['RANK']) == 1 else 0)
"""


def _restart_mid_attempt(agents: Agents, plane: FakeControlPlane, code: int) -> tuple[Agent, LaunchSpec]:
    first = agents.start(keep_workers_on_exit=True)
    go = agents.tmp_path / f"go-{code}"
    spec = agents.spec("wait.py", WAIT_THEN_EXIT, args=[str(go), str(code)])
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    first.stop()  # the workers stay; torchrun is no child of the next agent
    second = agents.start()
    run = second.run(spec.attempt_id)
    assert run is not None and run.adopted and run.alive
    go.touch()
    return second, spec


def test_adopted_attempt_that_exits_cleanly_succeeds(agents: Agents, plane: FakeControlPlane) -> None:
    _, spec = _restart_mid_attempt(agents, plane, 0)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert final.exit_code == 0 and final.error is None
    assert [(w.rank, w.exit_code) for w in final.workers] == [(0, 0), (1, 0)]


def test_adopted_attempt_with_a_failed_rank_names_it(agents: Agents, plane: FakeControlPlane) -> None:
    _, spec = _restart_mid_attempt(agents, plane, 3)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert final.exit_code not in (0, None)
    assert final.error is not None and "rank 1 exited with 3" in final.error


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_each_earlier_module_name_runs_the_module(module: str) -> None:
    """What an earlier agent, or a torchrun it started, may still start by name after an upgrade
    moved the module (node_agent/ranks/entry_points.py): the alias runs the module itself."""
    for old in OLD_NAMES[module]:
        done = subprocess.run([sys.executable, "-m", old], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and done.stderr.startswith(f"usage: python -m {module} "), done.stderr
        assert started_as([sys.executable, "-m", old, "x"], module, within=4)
        assert not started_as([sys.executable, "x", "-m", old], module, within=2)


def test_an_upgraded_agent_adopts_workers_started_under_the_old_module_names(
    agents: Agents, plane: FakeControlPlane, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent upgrade across the move of the agent's modules into folders: the earlier agent
    started torchrun as ``-m node_agent.torchrun_entry`` and its ranks as ``-m node_agent.rank_shim``
    (here: the same launch with the names it had), whose torchrun starts the shims by that name after
    the move (the aliases at the old names run them). The new agent adopts the part, sees its workers
    and reports their exits exactly; what recognises the processes by their command line (the dev
    cluster's kill-workers) finds them under either name."""
    from node_agent.part import commands

    old_entry, old_shim = OLD_NAMES[TORCHRUN_ENTRY][0], OLD_NAMES[RANK_SHIM][0]
    assert (old_entry, old_shim) == ("node_agent.torchrun_entry", "node_agent.rank_shim")
    with monkeypatch.context() as earlier:
        earlier.setattr(commands, "TORCHRUN_ENTRY", old_entry)
        earlier.setattr(commands, "RANK_SHIM", old_shim)
        first = agents.start(keep_workers_on_exit=True)
        go = agents.tmp_path / "go-upgrade"
        spec = agents.spec("wait.py", WAIT_THEN_EXIT, args=[str(go), "3"])
        plane.assign(NODE, spec)
        wait_state(plane, spec.attempt_id, NodeAttemptState.running)
        first.stop()  # the workers stay
    procs = [psutil.Process(pid) for pid in attempt_pids(spec.attempt_id)]
    cmdlines = [proc.cmdline() for proc in procs]
    torchruns = [c for c in cmdlines if started_as(c, TORCHRUN_ENTRY, within=4)]
    shims = [c for c in cmdlines if started_as(c, RANK_SHIM, within=4)]
    assert len(torchruns) == 1 and old_entry in torchruns[0] and TORCHRUN_ENTRY not in torchruns[0]
    assert len(shims) == 2 and all(old_shim in c and RANK_SHIM not in c for c in shims), cmdlines
    workers = [proc for proc in procs if is_training(proc)]
    assert len(workers) == 2  # each the child of a shim started by its old name

    second = agents.start()  # the new agent
    run = second.run(spec.attempt_id)
    assert run is not None and run.adopted and run.alive
    wait_for(lambda: {proc.pid for proc in procs} <= set(run.watched_pids()), what="the adopted part's processes")
    go.touch()
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert [(w.rank, w.exit_code) for w in final.workers] == [(0, 0), (1, 3)]
    assert final.error is not None and "rank 1 exited with 3" in final.error
    assert not run.alive and all(not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE for proc in procs)


QUICK = "import sys\nprint('done', flush=True)\nsys.exit(0)\n"


def test_attempt_stays_listed_until_its_final_status_is_acknowledged(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    spec = agents.spec("quick.py", QUICK)
    plane.refuse_status.add(spec.attempt_id)  # its final status cannot be delivered for now
    plane.assign(NODE, spec)
    run = wait_for(lambda: agent.run(spec.attempt_id), what="the launch")
    wait_for(lambda: run.finished, what="the processes to end")

    def listed() -> list[LocalAttempt]:
        hb = plane.last_heartbeat(NODE)
        return [] if hb is None else [a for a in hb.attempts if a.attempt_id == spec.attempt_id]

    seq = plane.last_heartbeat(NODE).seq  # type: ignore[union-attr]
    wait_for(lambda: plane.last_heartbeat(NODE).seq >= seq + 5, what="heartbeats")  # type: ignore[union-attr]
    # Processes gone, final status pending: still listed, so the control plane cannot call it vanished.
    assert [(a.processes_alive, a.final_status_pending) for a in listed()] == [(False, True)]
    assert plane.last_status(spec.attempt_id) is None
    plane.refuse_status.clear()
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert final.exit_code == 0 and final.error is None
    wait_for(lambda: not listed(), what="the attempt to leave heartbeats once acknowledged")


BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


@pytest.mark.parametrize("mismatch", ["start_time", "boot_id"])
def test_a_reused_process_group_id_is_never_signalled(tmp_path: Path, mismatch: str) -> None:
    # An unrelated process group whose id equals the pgid a previous agent saved (as after a reboot
    # or a long outage): the adopted attempt must neither count it as its own nor signal it.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        started = psutil.Process(bystander.pid).create_time()
        spec = make_spec()
        paths = attempt_paths(tmp_path / "agent", spec.attempt_id)
        paths.root.mkdir(parents=True)
        state = {
            "spec": spec.model_dump(mode="json"), "pid": bystander.pid, "pgid": bystander.pid,
            "create_time": started - 1000.0 if mismatch == "start_time" else started,
            "boot_id": "00000000-0000-0000-0000-000000000000" if mismatch == "boot_id" else BOOT_ID.read_text().strip(),
            "torchrun_done": False, "exit_code": None, "error": None, "stop_reason": None, "stopped": False,
            "final_acked": False, "done": False,
        }
        paths.state_file.write_text(json.dumps(state))
        run = Part.adopt(paths, stop_grace_s=0.1)
        assert run is not None
        for _ in range(5):
            run.poll()
            run.kill_now()
            time.sleep(0.05)
        assert not run.alive and run.finished
        assert bystander.poll() is None, "the unrelated process group was signalled"
        assert run.report(None, None).error is not None
    finally:
        bystander.kill()
        bystander.wait(5)


def test_a_rejected_final_status_is_an_answer_and_the_attempt_leaves(agents: Agents, plane: FakeControlPlane) -> None:
    # A 4xx (not 401/409) will be given again to every resend: the attempt must not stay listed as
    # pending forever (the control plane then decides without its final status).
    agent = agents.start()
    spec = agents.spec("quick.py", QUICK)
    plane.reject_status.add(spec.attempt_id)
    plane.assign(NODE, spec)
    run = wait_for(lambda: agent.run(spec.attempt_id), what="the launch")
    wait_for(lambda: run.finished, what="the processes to end")
    wait_for(lambda: agent.run(spec.attempt_id) is None, what="the agent to be done with it")
    hb = plane.last_heartbeat(NODE)
    seq = hb.seq  # type: ignore[union-attr]
    wait_for(lambda: plane.last_heartbeat(NODE).seq > seq, what="a heartbeat")  # type: ignore[union-attr]
    assert spec.attempt_id not in {a.attempt_id for a in plane.last_heartbeat(NODE).attempts}  # type: ignore[union-attr]


def test_a_rejected_status_is_dropped_not_resent(agents: Agents, plane: FakeControlPlane) -> None:
    """Issue 11, finding 10: a report the control plane refuses for what it says (4xx) would be
    refused again: the agent drops it (logged) and sends the next one that differs, instead of
    resending the same one every round."""
    agent = agents.start()
    spec = agents.spec("sleepy.py", "import time\ntime.sleep(60)\n")
    plane.reject_status.add(spec.attempt_id)
    plane.assign(NODE, spec)
    run = wait_for(lambda: agent.run(spec.attempt_id), what="the launch")
    wait_for(lambda: plane.rejected[spec.attempt_id] and run.report(None, None).state == "running"
             and run.report(None, None).workers, what="a rejected running report")
    time.sleep(1.0)  # the report settles (its workers all seen)
    before = plane.rejected[spec.attempt_id]
    time.sleep(4 * agents.config().status_interval_s)  # four resend periods
    assert plane.rejected[spec.attempt_id] - before <= 1
    assert run.alive  # dropping a report stops nothing
