"""The agent's loops against a fake control plane served over real HTTP, with real torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from node_agent.agent import Agent, AgentConfig
from node_agent.confinement import processes
from node_agent.link import credential
from tests.node_agent import worker_client
from tests.node_agent.fake_control_plane import FakeControlPlane
from tests.node_agent.helpers import free_port, make_spec, wait_for, write_script
from trainyard.protocol.agent import LaunchSpec, NodeAttemptState, WorkerState

NODE = "node-a"

REPORTER = """
import os, sys
from tests.node_agent.worker_client import post as _post

def post(kind, body):
    status, answer = _post(kind, body, timeout=5)
    assert status == 200, answer

rank = int(os.environ["RANK"])
for step in (1, 2, 3):
    post("progress", {"rank": rank, "step": step * 10 + rank, "loss": 1.0 / step})
print(f"hello from rank {rank} \\u00fcn\\u00ef")
print(f"warning from rank {rank}", file=sys.stderr)
if rank == 0:
    post("result", {"rank": 0, "result": {"final_loss": 0.25}})
"""

SLEEPER = "import time\nprint('sleeping', flush=True)\ntime.sleep(120)\n"

CHECKPOINTER = """
import json, os, sys, time
from tests.node_agent.worker_client import post as _post

mode, out = sys.argv[1], sys.argv[2]

def post(path, body):
    return list(_post(path.lstrip("/"), body))

def shard(step):
    key = f"ckpt/step-{step}/rank-0"
    return {"rank": 0, "step": step, "world_size": 1, "key": key, "size_bytes": 3, "sha256": "ab" * 32}

def event(kind):
    return {"rank": 0, "kind": kind, "message": kind, "data": {"step": 0}}

def write(name, value):
    with open(out + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(out + ".tmp", out + name)

if mode == "stale":
    write(".wait", post("/shards?wait=1", shard(10)))
    time.sleep(120)
env = {k: v for k, v in os.environ.items()
       if k.startswith(("TRAINYARD_S3_", "TRAINYARD_CHECKPOINT_PREFIX", "TRAINYARD_STORAGE_"))}
posts = [post("/events", event("checkpoint.restored")), post("/shards", shard(10)),
         post("/events", event("train.note")), post("/shards", shard(20))]
write(".first", {"env": env, "posts": [code for code, _ in posts], "wait": post("/shards?wait=1", shard(30))})
while not os.path.exists(out + ".go"):
    time.sleep(0.02)
# The control plane is down now: queued all the same, just before the exit.
write(".last", [post("/shards", shard(40))[0], post("/events", event("train.end"))[0]])
"""


class Agents:
    def __init__(self, tmp_path: Path, plane: FakeControlPlane) -> None:
        self.tmp_path = tmp_path
        self.plane = plane
        self.agents: list[Agent] = []
        self.attempt_ids: set[str] = set()

    def config(self, **overrides: Any) -> AgentConfig:
        fields: dict[str, Any] = {
            "control_plane_url": self.plane.url,
            "join_token": self.plane.join_token,
            "name": NODE,
            "address": "127.0.0.2",
            "virtual_gpus": 2,
            "work_dir": self.tmp_path / "agent",
            "labels": {"rack": "r1"},
            "stop_grace_s": 1.0,
            "status_interval_s": 1.0,
            "poll_interval_s": 0.1,
            "rdzv_join_timeout_s": 60,
        }
        fields.update(overrides)
        return AgentConfig(**fields)

    def start(self, **overrides: Any) -> Agent:
        agent = Agent(self.config(**overrides))
        self.agents.append(agent)
        agent.start()
        return agent

    def spec(self, script: str, body: str, **overrides: Any) -> LaunchSpec:
        write_script(self.tmp_path, script, body)
        spec = make_spec(entrypoint=str(self.tmp_path / script), **overrides)
        self.attempt_ids.add(spec.attempt_id)
        return spec

    def cleanup(self) -> None:
        for agent in self.agents:
            agent.stop(timeout=5)
        table = processes.scan()
        for attempt_id in self.attempt_ids:
            for pid in table.by_attempt.get(attempt_id, ()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
def plane() -> Iterator[FakeControlPlane]:
    plane = FakeControlPlane().start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def agents(tmp_path: Path, plane: FakeControlPlane) -> Iterator[Agents]:
    agents = Agents(tmp_path, plane)
    try:
        yield agents
    finally:
        agents.cleanup()


def attempt_pids(attempt_id: str) -> set[int]:
    return set(processes.scan().by_attempt.get(attempt_id, ()))


def gone(pids: set[int]) -> bool:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return False
    return True


def wait_state(plane: FakeControlPlane, attempt_id: str, state: NodeAttemptState, timeout: float = 30) -> Any:
    def reached() -> Any:
        report = plane.last_status(attempt_id)
        return report if report is not None and report.state == state else None

    return wait_for(reached, timeout=timeout, interval=0.1, what=f"{attempt_id} to be {state}")


def test_registers_late_control_plane_and_reregisters_after_401(agents: Agents) -> None:
    # The agent starts before its control plane exists: it keeps trying.
    port = free_port()
    agent = agents.start(control_plane_url=f"http://127.0.0.1:{port}")
    assert not agent.state.registered.wait(0.5)
    late = FakeControlPlane(port=port).start()
    try:
        wait_for(lambda: late.registrations, what="registration")
        (registration,) = late.registrations
        assert registration.name == NODE and registration.address == "127.0.0.2"
        assert [g.uuid for g in registration.gpus] == [f"virtual-{NODE}-0", f"virtual-{NODE}-1"]
        assert registration.labels == {"rack": "r1"}
        wait_for(lambda: late.last_heartbeat(NODE), what="a heartbeat")
        late.forget_nodes()
        wait_for(lambda: len(late.registrations) == 2, what="re-registration after 401")
        seq_before = late.last_heartbeat(NODE).seq  # type: ignore[union-attr]
        wait_for(lambda: late.last_heartbeat(NODE).seq > seq_before, what="heartbeats again")  # type: ignore[union-attr]
        assert agent.state.node_id == late.node_ids[NODE]
    finally:
        agent.stop(timeout=5)
        late.stop()


def test_a_restarted_agent_registers_with_its_kept_credential(agents: Agents, plane: FakeControlPlane) -> None:
    """Issue 11, finding 2: the join token is for the first registration only (it expires or is
    single-use); the agent keeps its node credential in its work dir, 0600, and uses it after."""
    first = agents.start()
    wait_for(lambda: first.state.registered.is_set(), what="registration")
    kept = agents.tmp_path / "agent" / credential.CREDENTIAL_FILE
    assert kept.stat().st_mode & 0o777 == 0o600
    assert kept.read_text().strip() in plane.tokens and plane.registered_with == ["join"]
    first.stop(timeout=5)
    second = agents.start(join_token="")  # no join token any more
    wait_for(lambda: second.state.registered.is_set(), what="registration with the credential")
    assert plane.registered_with == ["join", "credential"]
    assert kept.read_text().strip() in plane.tokens  # the new credential, kept again
    second.stop(timeout=5)
    with pytest.raises(ValueError, match="no join token"):
        agents.config(join_token="", work_dir=agents.tmp_path / "fresh")


def test_runs_an_assigned_attempt_and_reports_it(agents: Agents, plane: FakeControlPlane) -> None:
    agents.start()
    spec = agents.spec("report.py", REPORTER)
    plane.assign(NODE, spec)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert final.exit_code == 0 and final.error is None
    assert final.fencing_token == spec.fencing_token and final.node_rank == 0
    assert [(w.rank, w.state, w.exit_code) for w in final.workers] == [
        (0, WorkerState.exited, 0),
        (1, WorkerState.exited, 0),
    ]
    assert final.progress is not None and final.progress.step == 31
    assert final.result == {"final_loss": 0.25}
    expected = {
        (rank, stream): f"{word} from rank {rank}{suffix}\n"
        for rank in (0, 1)
        for stream, word, suffix in (("stdout", "hello", " ünï"), ("stderr", "warning", ""))
    }

    def shipped() -> bool:
        return all(plane.log_text(spec.attempt_id, 0, r, st) == text for (r, st), text in expected.items())

    wait_for(shipped, what="every rank's stdout and stderr to be shipped")
    wait_for(lambda: plane.heartbeat_attempts(NODE) == set(), what="the attempt to leave heartbeats")
    # It leaves heartbeats once its processes are gone, which may be before its final status is
    # acknowledged (and it is done after that): once both happened, nothing about it changes.
    state_file = agents.tmp_path / "agent" / "attempts" / spec.attempt_id / "state.json"
    wait_for(lambda: all(json.loads(state_file.read_text())[k] for k in ("final_acked", "done")),
             what="the final status to be acknowledged and the attempt done")
    # Still assigned, but it ran here once: it is never launched again.
    state = json.loads(state_file.read_text())
    count = plane.status_count(spec.attempt_id)
    seq = plane.last_heartbeat(NODE).seq  # type: ignore[union-attr]
    wait_for(lambda: plane.last_heartbeat(NODE).seq >= seq + 5, what="more heartbeats")  # type: ignore[union-attr]
    assert json.loads(state_file.read_text()) == state
    assert state["done"] and state["final_acked"]
    # The agent's state is its own (state.json holds the fencing token); the worker dir is gone.
    work_dir = agents.tmp_path / "agent"
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_file.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((work_dir / "attempts").stat().st_mode) == 0o700
    assert stat.S_IMODE(work_dir.stat().st_mode) == 0o711
    assert not (work_dir / "workers" / f"{spec.attempt_id}.0").exists()
    assert plane.status_count(spec.attempt_id) == count
    assert not attempt_pids(spec.attempt_id)


def test_unassigned_attempt_is_stopped(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[1])
    before = time.monotonic()
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    wait_for(lambda: plane.heartbeat_attempts(NODE) == {spec.attempt_id}, what="the attempt in heartbeats")
    pids = attempt_pids(spec.attempt_id)
    assert len(pids) == 3  # torchrun, shim, worker
    # An answer to a request that left before the attempt arrived (the long poll and the heartbeat
    # are read at different moments) may predate its assignment: its silence stops nothing.
    agent.desired.reconcile([], [], sent_at=before)
    run = agent.run(spec.attempt_id)
    assert run is not None and not run.stopping and run.alive
    plane.assign(NODE)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.stopped, timeout=30)
    assert gone(pids)
    assert final.workers[0].state == WorkerState.exited
    wait_for(lambda: plane.heartbeat_attempts(NODE) == set(), timeout=15, what="heartbeats without it")
    wait_for(lambda: "sleeping" in plane.log_text(spec.attempt_id, 0, 0, "stdout"), what="the last log bytes")


def test_supervision_is_woken_by_rank_files_and_exits_not_by_its_poll(agents: Agents, plane: FakeControlPlane) -> None:
    """Issue 14 (decision and process start): with a poll interval longer than the test, a worker's
    start (its rank file: inotify), its exit and the end of every process of a stopped attempt
    (pidfds) still reach the control plane: supervision is woken by them, not by its period."""
    agents.start(poll_interval_s=600.0, status_interval_s=600.0)
    spec = agents.spec("exit.py", "import sys, time\ntime.sleep(1)\nsys.exit(3)\n", nproc_per_node=1,
                       gpu_indices=[0])
    sleeper = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[1])
    plane.assign(NODE, spec, sleeper)
    wait_state(plane, sleeper.attempt_id, NodeAttemptState.running)
    final = wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    assert [(w.state, w.exit_code) for w in final.workers] == [(WorkerState.exited, 3)]
    pids = attempt_pids(sleeper.attempt_id)
    plane.assign(NODE, spec)  # the sleeper is no longer assigned: stopped (SIGTERM)
    stopped = wait_state(plane, sleeper.attempt_id, NodeAttemptState.stopped)
    assert not stopped.processes_alive and gone(pids)


def test_stale_attempt_is_stopped_and_no_longer_reported(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    pids = attempt_pids(spec.attempt_id)
    plane.stale.add(spec.attempt_id)  # still assigned: the 409 alone must stop it
    wait_for(lambda: gone(pids), timeout=10, what="the stale attempt's processes to go")
    wait_for(lambda: plane.heartbeat_attempts(NODE) == set(), timeout=5, what="heartbeats without it")
    wait_for(lambda: agent.run(spec.attempt_id) is None, timeout=5, what="the agent to forget it")
    assert plane.last_status(spec.attempt_id).state == NodeAttemptState.running  # type: ignore[union-attr]


LAST_WORDS = """
import signal, sys, time
def bye(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the agent, torchrun and the shim each send one
    print('last words', flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, bye)
print('started', flush=True)
while True:
    time.sleep(0.1)
"""


def test_a_superseded_attempts_last_log_lines_are_shipped_before_its_directory_goes(
        agents: Agents, plane: FakeControlPlane) -> None:
    """A part fenced off (its attempt replaced after a failure) stopped shipping its logs at once:
    what its ranks wrote from then on, their last words before the stop included, was never sent,
    and its worker directory, which held it, was removed (found by tests/e2e/test_user_resume.py:
    the surviving rank's last steps were missing from ``trainyard logs --attempt N``). The control
    plane keeps a replaced attempt's logs; the agent now ships them to the end, then forgets it."""
    agent = agents.start()
    spec = agents.spec("words.py", LAST_WORDS, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    wait_for(lambda: "started" in plane.log_text(spec.attempt_id, 0, 0, "stdout"), what="the first line")
    run = agent.run(spec.attempt_id)
    assert run is not None
    worker_dir = run.paths.worker
    pids = attempt_pids(spec.attempt_id)
    plane.superseded.add(spec.attempt_id)  # still assigned: the 409 to its status report stops it
    wait_for(lambda: gone(pids), timeout=15, what="the replaced attempt's processes to go")
    wait_for(lambda: agent.run(spec.attempt_id) is None, timeout=15, what="the agent to forget it")
    assert plane.log_text(spec.attempt_id, 0, 0, "stdout") == "started\nlast words\n"
    wait_for(lambda: not worker_dir.exists(), timeout=5, what="its worker directory to be removed")
    assert plane.last_status(spec.attempt_id).state == NodeAttemptState.running  # type: ignore[union-attr]


# What an old control plane sent: the root keys. Workers get presigned URLs instead (issue 11,
# finding 3): whatever the spec says, no credential reaches a worker or the agent's state.
STORAGE = {"endpoint": "127.0.0.1:9000", "bucket": "ckpts", "access_key": "AK", "secret_key": "s3cr3t-value",
           "secure": True, "region": "us-east-1", "prefix": "jobs/job-1/checkpoints", "access": "presigned"}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def test_shards_and_events_are_relayed_in_order_across_an_outage(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    out = agents.tmp_path / "ckpt"
    spec = agents.spec("ckpt.py", CHECKPOINTER, nproc_per_node=1, gpu_indices=[0], args=["run", str(out)],
                       storage=STORAGE)
    plane.assign(NODE, spec)
    first = wait_for(lambda: read_json(out.with_suffix(".first")), what="the worker's first posts")
    assert first["posts"] == [202, 202, 202, 202]  # queued, not waiting on the control plane
    code, ack = first["wait"]  # the ShardAck of the batch holding step 30 (step 20 may be in it too)
    assert code == 200 and 30 in ack["committed_steps"] and ack["accepted"] >= 1
    assert first["env"] == {
        "TRAINYARD_STORAGE_ACCESS": "presigned", "TRAINYARD_CHECKPOINT_PREFIX": "jobs/job-1/checkpoints",
    }
    state = (agents.tmp_path / "agent" / "attempts" / spec.attempt_id / "state.json").read_text()
    assert "s3cr3t-value" not in state

    plane.down = True  # the worker's last shard and event are buffered, its exit is not reported
    (out.with_suffix(".go")).touch()
    assert wait_for(lambda: read_json(out.with_suffix(".last")), what="the last posts") == [202, 202]
    run = agent.run(spec.attempt_id)
    assert run is not None
    wait_for(lambda: run.finished and agent.relaying.relay.failed_sends > 0, what="the worker's exit during the outage")
    assert agent.state.outbox.pending(spec.attempt_id) == 2
    plane.down = False
    wait_state(plane, spec.attempt_id, NodeAttemptState.exited)
    arrived = plane.arrived(spec.attempt_id)
    relayed = [a for a in arrived if not a.startswith("status:")]
    assert relayed == ["event:checkpoint.restored", "shard:10:0", "event:train.note", "shard:20:0", "shard:30:0",
                       "shard:40:0", "event:train.end"]
    # The end is reported only after the checkpoint reported just before it.
    assert arrived.index("status:exited") > arrived.index("event:train.end")
    assert plane.senders[spec.attempt_id] == {(spec.fencing_token, 0)}


def test_stale_answer_to_a_shard_stops_the_attempt(agents: Agents, plane: FakeControlPlane) -> None:
    agent = agents.start()
    out = agents.tmp_path / "stale"
    spec = agents.spec("ckpt.py", CHECKPOINTER, nproc_per_node=1, gpu_indices=[0], args=["stale", str(out)])
    plane.stale_shards.add(spec.attempt_id)  # status reports are still accepted: the shard's 409 alone
    plane.assign(NODE, spec)
    wait_for(lambda: plane.refused_stale[spec.attempt_id], timeout=30, what="the control plane's 409")
    wait_for(lambda: agent.run(spec.attempt_id) is None, timeout=30, what="the agent to stop and forget it")
    # The 409 stops the attempt at once, so the worker may be killed before it records its answer;
    # when it did record one, it is the 409.
    answer = read_json(out.with_suffix(".wait"))
    if answer:
        code, problem = answer
        assert code == 409 and problem["status"] == 409
    assert not attempt_pids(spec.attempt_id)
    last = plane.last_status(spec.attempt_id)
    assert last is None or last.state in (NodeAttemptState.launching, NodeAttemptState.running)


def test_control_plane_stop_ack_stops_the_attempt(agents: Agents, plane: FakeControlPlane) -> None:
    agents.start()
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    plane.stop_requested.add(spec.attempt_id)
    wait_state(plane, spec.attempt_id, NodeAttemptState.stopped, timeout=10)


def test_restarted_agent_adopts_and_outage_keeps_workers(agents: Agents, plane: FakeControlPlane) -> None:
    first = agents.start(keep_workers_on_exit=True)
    spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0])
    plane.assign(NODE, spec)
    wait_state(plane, spec.attempt_id, NodeAttemptState.running)
    pids = attempt_pids(spec.attempt_id)
    socket_path = first.local_api_socket(spec.attempt_id)
    assert socket_path is not None
    first.stop()
    assert attempt_pids(spec.attempt_id) == pids  # kept running
    assert not Path(socket_path).exists()

    second = agents.start()
    assert second.local_api_socket(spec.attempt_id) == socket_path  # its workers' TRAINYARD_AGENT_SOCKET
    status, _ = worker_client.request("GET", "/healthz", socket_path=socket_path, timeout=5)
    assert status == 200
    run = second.run(spec.attempt_id)
    assert run is not None and run.adopted and run.alive
    instance_hb = lambda: [hb for _, hb in plane.heartbeats if hb.agent_instance == second.state.instance]  # noqa: E731
    wait_for(lambda: len(instance_hb()) >= 3, what="heartbeats of the new agent")
    assert {a.attempt_id for a in instance_hb()[-1].attempts} == {spec.attempt_id}
    assert attempt_pids(spec.attempt_id) == pids  # adopted, not relaunched

    plane.down = True  # an outage: workers keep running, the agent keeps trying
    count = plane.status_count(spec.attempt_id)
    seq = instance_hb()[-1].seq
    wait_for(lambda: second.run(spec.attempt_id) and second.heartbeat._seq > seq + 3,
             what="heartbeats during the outage")
    assert attempt_pids(spec.attempt_id) == pids
    plane.down = False
    wait_for(lambda: plane.status_count(spec.attempt_id) > count, what="reports after the outage")

    second.stop()  # default: the workers go with the agent
    assert gone(pids)


def test_cli_runs_until_sigterm_and_stops_its_workers(agents: Agents, plane: FakeControlPlane, tmp_path: Path) -> None:
    token_file = tmp_path / "join-token"
    token_file.write_text(plane.join_token + "\n")
    cmd = [sys.executable, "-m", "node_agent", "--control-plane", plane.url, "--join-token-file", str(token_file)]
    cmd += ["--name", "cli-node", "--address", "127.0.0.3", "--virtual-gpus", "1", "--label", "rack=r9"]
    cmd += ["--work-dir", str(tmp_path / "cli-agent"), "--stop-grace", "1"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: plane.registrations, what="the CLI agent to register")
        assert plane.registrations[0].labels == {"rack": "r9"}
        spec = agents.spec("sleep.py", SLEEPER, nproc_per_node=1, gpu_indices=[0], rdzv_host="127.0.0.3")
        plane.assign("cli-node", spec)
        wait_state(plane, spec.attempt_id, NodeAttemptState.running)
        pids = attempt_pids(spec.attempt_id)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        assert gone(pids)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def test_no_gpu_without_virtual_slots_is_a_clear_error() -> None:
    from node_agent.gpus import NoGpusError, discover_gpus

    try:
        gpus = discover_gpus(None, "n")
    except NoGpusError as exc:
        assert "--virtual-gpus" in str(exc)
    else:  # a machine with NVIDIA GPUs
        assert gpus and all(g.kind != "virtual-cpu" for g in gpus)


def test_request_timeout_is_derived_from_the_registered_heartbeat_settings(agents: Agents,
                                                                          plane: FakeControlPlane) -> None:
    """Finding 10: 3 tries of 10 s no longer outlast a 10 s node-lost timeout."""
    from trainyard.protocol.agent import agent_request_timeout_s

    agent = agents.start()
    assert agent.state.registered.wait(20)
    expected = agent_request_timeout_s(plane.heartbeat_interval_s, 10.0)
    assert agent.state.client.heartbeat_timeout.read == pytest.approx(expected)
    assert expected * agent.state.client.retry.attempts < 10.0


def test_standbys_need_tracked_workers_and_the_idle_ones_go_with_the_agent(
    agents: Agents, plane: FakeControlPlane, tmp_path: Path
) -> None:
    """--standbys (node_agent/ranks/standby_pool.py): refused where the agent could find an attempt's
    processes only by the variables they started with; else kept warm, and killed at stop."""
    from node_agent.confinement.isolation import IsolationError

    run = Path(tempfile.mkdtemp(prefix="sb-", dir="/tmp"))  # short: unix socket paths hold 107 bytes
    with pytest.raises(IsolationError, match="--standbys needs workers tracked by cgroup v2 or by uid"):
        agents.start(standbys=2, cgroups=False, run_dir=run, work_dir=tmp_path / "refused")
    # A run dir too deep for a standby's socket is refused at start, not left with standbys that die
    # at once (CI's pytest temp dirs are that deep: the pool turned itself off and nothing said why).
    deep = tmp_path / ("d" * 60)
    with pytest.raises(IsolationError, match="use a shorter --run-dir"):
        agents.start(standbys=2, run_dir=deep, work_dir=tmp_path / "deep")
    agent = agents.start(standbys=2, run_dir=run)
    isolation = agent.state.isolation
    assert isolation is not None and isolation.cgroups is not None  # this machine (and CI) have one
    assert agent.state.standbys is not None and agent.state.node is not None
    directory = agent.state.standbys.directory
    assert agent.state.node.standby_dir == str(directory) and directory.parent == run / "standby"
    wait_for(lambda: len(list(directory.glob("*.sock"))) == 2, timeout=60, what="two warm standbys")
    pool = agent.state.standbys
    pids = {s.pid for s in pool._standbys} | {pool.zygote_pid}  # noqa: SLF001 - the two standbys and their zygote
    assert len(pids) == 3 and all(psutil.pid_exists(pid) for pid in pids)
    agent.stop(timeout=5)
    assert gone(pids) and not directory.exists()
    shutil.rmtree(run, ignore_errors=True)
