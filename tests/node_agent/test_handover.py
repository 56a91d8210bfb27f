"""The agent's side of a handover (issue 14, in-process restart): a parked part's workers poll their own
socket with their own token and are told ``waiting``, then their part of the next attempt, or
``stop``; any other token is refused, and an agent that hands nothing over answers 404."""

from __future__ import annotations

import json
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import httpx
import pytest
import structlog

from node_agent.agent import Agent
from node_agent.config import AgentConfig
from node_agent.confinement.isolation import Isolation
from node_agent.link.client import StaleAttempt
from node_agent.local.api import LocalApi
from node_agent.local.handover import Handovers
from node_agent.memtier.tier import MemoryTier
from node_agent.part.attempt import Part
from node_agent.part.code import CodeUnavailable, ShippedCode
from node_agent.part.commands import AttemptPaths, NodeContext
from node_agent.part.parts import Parts
from tests.node_agent.helpers import make_spec
from trainyard.protocol.agent import AssignmentRef, CodeRef, NodeAttemptState
from trainyard.protocol.env import global_rank
from trainyard.protocol.memtier import LOCAL_MEMORY_KIND, TOKEN_HEADER, MemoryTierSpec
from trainyard.protocol.restart import NextAssignmentAnswer


@pytest.fixture
def sockets() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="ho-", dir="/tmp") as directory:
        yield Path(directory)


def _ask(api: LocalApi, attempt_id: str, token: str, rank: int, wait_s: float = 0.0) -> httpx.Response:
    path = api.socket_of(attempt_id)
    assert path is not None
    with httpx.Client(base_url="http://agent", transport=httpx.HTTPTransport(uds=str(path)), timeout=10) as http:
        return http.post(f"/v1/local/attempts/{attempt_id}/next-assignment",
                         json={"fencing_token": token, "rank": rank, "wait_s": wait_s})


def test_a_parked_part_is_told_waiting_then_its_new_ranks_and_another_token_is_refused(sockets: Path) -> None:
    handovers = Handovers()
    api = LocalApi(handovers=handovers)
    old = make_spec(attempt_id="att-old", nnodes=2, node_rank=1, restartable=True)
    new = make_spec(attempt_id="att-new", attempt_number=2, nnodes=2, node_rank=0, restartable=True,
                    adopts="att-old", rdzv_host="127.0.0.5")
    try:
        api.open(old.attempt_id, sockets / "old.sock")
        handovers.register(old.attempt_id, old.fencing_token, node_rank=1, nproc=2)
        assert _ask(api, old.attempt_id, "not-the-token", 2).status_code == 409
        first = _ask(api, old.attempt_id, old.fencing_token, 2)
        assert first.status_code == 200 and NextAssignmentAnswer.model_validate(first.json()).state == "waiting"
        assert handovers.hand_over(old.attempt_id, new, "/run/new.sock") is False  # not parked: nothing given
        assert handovers.park(old.attempt_id, 30.0) and handovers.parked(old.attempt_id)
        answers: dict[int, httpx.Response] = {}
        polls = [threading.Thread(target=lambda r=r: answers.__setitem__(r, _ask(api, old.attempt_id,
                                                                                   old.fencing_token, r, 10.0)))
                 for r in (2, 3)]
        for t in polls:
            t.start()
        time.sleep(0.2)  # both long polls wait for the handover
        assert handovers.hand_over(old.attempt_id, new, "/run/new.sock")
        for t in polls:
            t.join(10)
        for rank, response in answers.items():
            answer = NextAssignmentAnswer.model_validate(response.json())
            assert answer.state == "assigned" and answer.assignment is not None
            a = answer.assignment
            # The same local rank (its GPU), now on node rank 0 of the new attempt.
            assert (a.attempt_id, a.fencing_token, a.rank, a.world_size) == ("att-new", new.fencing_token, rank - 2, 4)
            assert (a.rendezvous.host, a.rendezvous.port, a.agent_socket) == ("127.0.0.5", new.rdzv_port,
                                                                              "/run/new.sock")
        assert _ask(api, old.attempt_id, old.fencing_token, 7).status_code == 422  # not one of its ranks
        assert _ask(api, old.attempt_id, new.fencing_token, 2).status_code == 409  # the new token is not its own
    finally:
        api.stop()


def test_a_part_not_taken_over_is_told_stop_and_an_agent_without_handovers_answers_404(sockets: Path) -> None:
    handovers = Handovers()
    api = LocalApi(handovers=handovers)
    plain = LocalApi()
    try:
        api.open("att-1", sockets / "a.sock")
        plain.open("att-2", sockets / "b.sock")
        handovers.register("att-1", "tok-1", node_rank=0, nproc=1)
        assert handovers.park("att-1", 0.0)
        assert handovers.expired() == ["att-1"]
        handovers.give_up("att-1", "not taken over within 0s")
        answer = NextAssignmentAnswer.model_validate(_ask(api, "att-1", "tok-1", 0, 5.0).json())
        assert answer.state == "stop" and "not taken over" in answer.reason
        assert handovers.expired() == [] and not handovers.park("att-1", 5.0)  # given up for good
        assert _ask(plain, "att-2", "tok-2", 0).status_code == 404
        # A parked part whose attempt turned stale waits only a little longer for its successor.
        handovers.register("att-3", "tok-3", node_rank=0, nproc=1)
        assert handovers.park("att-3", 600.0) and handovers.expired() == []
        handovers.shorten("att-3", 0.0)
        assert handovers.expired() == ["att-3"]
        assert not handovers.park("att-unknown", 5.0)  # a part that is not restartable is never parked
    finally:
        api.stop()
        plain.stop()


def _rank_file(worker: Path, rank: int, local_rank: int, pid: int) -> None:
    (worker / "status").mkdir(parents=True, exist_ok=True)
    (worker / "status" / f"rank-{rank}.json").write_text(json.dumps(
        {"rank": rank, "local_rank": local_rank, "pid": pid, "state": "running", "exit_code": None}))


def test_a_parked_part_is_taken_over_with_its_processes_and_recorded_for_an_agent_restart(tmp_path: Path,
                                                                                         process_reaper) -> None:
    """Relabel (Part.take_over): the new part is made of the parked part's torchrun and worker
    directory, reports their ranks in its own node rank, and its state.json says what it adopted (an
    agent restarted afterwards adopts it with the processes' original markers); the old part's
    state.json says where its processes went, and is never adopted again."""
    old_spec = make_spec(attempt_id="att-old", nnodes=2, node_rank=1, restartable=True)
    new_spec = make_spec(attempt_id="att-new", attempt_number=2, nnodes=2, node_rank=0, restartable=True,
                         adopts="att-old")
    old_paths = AttemptPaths(tmp_path / "attempts" / "att-old", tmp_path / "workers" / "att-old.1")
    old_paths.root.mkdir(parents=True)
    torchrun = process_reaper.spawn(["sleep", "60"], start_new_session=True)  # stands in for torchrun
    for local in (0, 1):
        _rank_file(old_paths.worker, 2 + local, local, torchrun.pid)
    old = Part(old_spec, old_paths, stop_grace_s=1.0)
    old._started(torchrun)
    old.poll()
    assert old.parkable() and not Part(make_spec(), old_paths, stop_grace_s=1.0).parkable()  # not restartable
    old.parked = True
    assert old.report(None, None).state == NodeAttemptState.parked

    new = Part.take_over(new_spec, AttemptPaths(tmp_path / "attempts" / "att-new", tmp_path / "unused"), old)
    assert (new.pid, new.paths.worker, new.marker) == (torchrun.pid, old_paths.worker, ("att-old", 1))
    new.poll()
    report = new.report(None, None)
    assert report.state == NodeAttemptState.running and report.fencing_token == new_spec.fencing_token
    assert [(w.rank, w.local_rank) for w in report.workers] == [(0, 0), (1, 1)]  # node rank 0's ranks now
    state = json.loads(new.paths.state_file.read_text())
    assert state["adopted_from"]["attempt_id"] == "att-old" and state["adopted_from"]["pid"] == torchrun.pid
    assert state["adopted_from"]["worker_dir"] == str(old_paths.worker) and state["marker"] == ["att-old", 1]
    before = json.loads(old_paths.state_file.read_text())
    assert before["handed_over_to"] == "att-new" and before["done"]
    # An agent restarted now adopts the new part (with its processes' markers), never the old one.
    assert Part.adopt(old_paths, stop_grace_s=1.0) is None
    again = Part.adopt(AttemptPaths(new.paths.root), stop_grace_s=1.0)
    assert again is not None and again.alive and again.marker == ("att-old", 1)
    assert [w.rank for w in again.report(None, None).workers] == [0, 1]


def test_only_a_restartable_worker_is_numbered_by_the_shim() -> None:
    """torchrun numbers a plain part's workers itself; a restartable part's shim derives the global
    rank from the node rank, since each node's torchrun sees its own node only."""
    base = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TRAINYARD_NODE_RANK": "3", "RANK": "1", "WORLD_SIZE": "2"}
    assert global_rank(base) is None
    assert global_rank({**base, "TRAINYARD_NNODES": "4"}) is None  # no fenced rendezvous: not restartable
    restartable = {**base, "TRAINYARD_NNODES": "4", "TRAINYARD_RENDEZVOUS": '{"host": "h", "port": 1}'}
    assert global_rank(restartable) == (7, 8)


# --- The agent's decisions (findings of the handover review) -------------------------------------


def _parked_run(tmp_path: Path, process_reaper, spec, attempts: Path | None = None) -> Part:
    """A restartable part whose workers all run (a sleep stands in for its torchrun)."""
    paths = AttemptPaths((attempts or tmp_path / "attempts") / spec.attempt_id, tmp_path / "workers" / spec.attempt_id)
    paths.root.mkdir(parents=True)
    torchrun = process_reaper.spawn(["sleep", "60"], start_new_session=True)
    for local in range(spec.nproc_per_node):
        _rank_file(paths.worker, spec.node_rank * spec.nproc_per_node + local, local, torchrun.pid)
    run = Part(spec, paths, stop_grace_s=0.5)
    run._started(torchrun)
    run.poll()
    assert run.parkable()
    return run


def _agent(tmp_path: Path, api: LocalApi | None = None) -> Agent:
    """An agent that is not started: its loops' decisions are called directly."""
    agent = Agent(AgentConfig(control_plane_url="http://127.0.0.1:9", join_token="j", name="n1",
                              address="127.0.0.2", virtual_gpus=2, work_dir=tmp_path / "agent",
                              stop_grace_s=0.5, handover_timeout_s=30.0))
    agent.state.isolation = Isolation(pool=None, cgroups=None)
    state = agent.state
    state.parts = Parts(agent.config, api or LocalApi(handovers=state.handovers), state.isolation, agent.log)
    state.node = NodeContext(local_addr="127.0.0.2", agent_url="http://a:1", virtual=True, base_env={"PATH": "/bin"})
    return agent


def _hold(agent: Agent, run: Part) -> None:
    agent.state.by_id[run.attempt_id] = run
    agent.state.handovers.register(run.attempt_id, run.spec.fencing_token, node_rank=run.spec.node_rank,
                             nproc=run.spec.nproc_per_node)


def _stop(attempt_id: str, handover_ok: bool) -> list[AssignmentRef]:
    return [AssignmentRef(attempt_id=attempt_id, desired="stop", version="v", handover_ok=handover_ok)]


def test_the_agent_parks_only_a_stop_that_allows_a_handover_and_stops_a_parked_part_that_no_longer_may(
        tmp_path: Path, process_reaper) -> None:
    """Findings 1 and 2: a cancel, a time limit, a hang or the blamed node's stop says handover_ok
    false, and the part stops at once; a parked part told so later (the job was cancelled while it
    waited) or whose park the control plane refused stops too."""
    agent = _agent(tmp_path)
    cancelled = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-a", restartable=True))
    _hold(agent, cancelled)
    agent.desired.reconcile([], _stop(cancelled.attempt_id, False))
    assert not cancelled.parked and cancelled.stopping
    assert not agent.state.handovers.parked(cancelled.attempt_id)

    healthy = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-b", restartable=True,
                                                              gpu_indices=[0, 1]))
    _hold(agent, healthy)
    agent.desired.reconcile([], _stop(healthy.attempt_id, True))
    assert healthy.parked and not healthy.stopping and agent.state.handovers.parked(healthy.attempt_id)
    agent.desired.reconcile([], [])  # an answer that names it no more says nothing new: still parked
    assert healthy.parked and not healthy.stopping
    agent.state.stop_or_park(healthy, "the control plane asked", handover_ok=False)  # e.g. cancelled meanwhile
    assert not healthy.parked and healthy.stopping
    answer = agent.state.handovers.answer(healthy.attempt_id, healthy.spec.fencing_token, 0, 0.0)
    assert answer is not None and answer.state == "stop"


def test_a_spec_never_starts_on_gpus_a_live_part_holds_and_a_claimed_part_is_not_given_up(
        tmp_path: Path, process_reaper) -> None:
    """Findings 3 and 4: a spec adopting a part that is no longer parked (given up, being stopped)
    waits until the old processes are gone instead of starting next to them; a takeover claims the
    parked part first, so its deadline or a stop order cannot stop the workers being handed over."""
    agent = _agent(tmp_path)
    old = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-old", restartable=True))
    _hold(agent, old)
    agent.state.stop_or_park(old, "the control plane asked", handover_ok=True)
    assert old.parked
    assert agent.state.handovers.claim(old.attempt_id) and not agent.state.handovers.claim(old.attempt_id)
    assert agent.state.handovers.give_up(old.attempt_id, "deadline") is False and agent.state.handovers.expired() == []
    agent.state.unpark(old, "stop order")
    assert old.parked and not old.stopping  # the claim holds: nothing told its workers to stop
    agent.state.handovers.release(old.attempt_id)
    agent.state.unpark(old, "not taken over")
    assert not old.parked and old.stopping

    new = make_spec(attempt_id="att-new", attempt_number=2, restartable=True, adopts=old.attempt_id)
    agent.state.launched_at[new.attempt_id] = time.monotonic()
    agent.desired.launch(new, _no_code(agent))  # the part fails at once, but only once its GPUs are free
    # old still holds GPUs 0, 1
    assert new.attempt_id not in agent.state.by_id and new.attempt_id in agent.state.pending
    agent.desired.launch_pending()
    assert new.attempt_id not in agent.state.by_id
    old.kill_now()
    deadline = time.monotonic() + 10
    while old.alive and time.monotonic() < deadline:
        old.poll()
        time.sleep(0.05)
    assert not old.alive
    agent.desired.launch_pending()
    assert new.attempt_id in agent.state.by_id and not agent.state.pending


def test_a_parked_part_stays_parked_across_an_agent_restart_with_its_own_deadline(
        tmp_path: Path, process_reaper) -> None:
    """Finding 3: the agent saves a part's parking and its deadline (state.json); a restarted agent
    serves it parked until that deadline, not a fresh one, so a takeover meanwhile finds it parked
    and nothing starts next to its workers."""
    agent = _agent(tmp_path)
    run = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-p", restartable=True),
                      attempts=agent.config.work_dir / "attempts")
    _hold(agent, run)
    agent.state.stop_or_park(run, "the control plane asked", handover_ok=True)
    assert run.parked and run.parked_until is not None

    again = _agent(tmp_path)
    again.supervision.adopt_existing()
    adopted = again.state.by_id[run.attempt_id]
    assert adopted.parked and adopted.parked_until == run.parked_until
    assert adopted.report(None, None).state == NodeAttemptState.parked
    assert again.state.handovers.parked(run.attempt_id) and again.state.handovers.expired() == []

    state = json.loads(run.paths.state_file.read_text())
    run.paths.state_file.write_text(json.dumps({**state, "parked_until": time.time() - 1}))
    late = _agent(tmp_path)
    late.supervision.adopt_existing()
    assert late.state.handovers.expired() == [run.attempt_id]  # its deadline passed while no agent ran
    late.supervision.step()
    assert late.state.by_id[run.attempt_id].stopping and not late.state.by_id[run.attempt_id].parked


def _no_code(agent: Agent) -> ShippedCode:
    """Code whose fetch fails: a part that gets this far fails at once (in its own thread)."""
    def fetch(into: BinaryIO, most: int, deadline: float) -> None:
        raise CodeUnavailable("no code here")
    return ShippedCode(ref=CodeRef(sha256="0" * 64, size_bytes=1), work_dir=agent.config.work_dir, fetch=fetch)


def test_a_spec_waits_while_an_orphan_lives_whatever_its_gpus(tmp_path: Path) -> None:
    """An orphan (an earlier agent instance's processes, being stopped) holds GPUs this agent cannot
    name, and the control plane may have passed them to the job's next attempt already (lease
    passing): a new part waits until no orphan is left, even on GPUs no part of this agent holds."""
    agent = _agent(tmp_path)
    agent.state.orphans.alive = frozenset({"att-before-the-restart"})
    new = make_spec(attempt_id="att-next", attempt_number=2, gpu_indices=[1])
    agent.state.launched_at[new.attempt_id] = time.monotonic()
    agent.desired.launch(new, _no_code(agent))
    assert new.attempt_id in agent.state.pending and new.attempt_id not in agent.state.by_id
    agent.desired.launch_pending()
    assert new.attempt_id in agent.state.pending
    agent.state.orphans.alive = frozenset()  # the sweep found them gone
    agent.desired.launch_pending()
    assert new.attempt_id in agent.state.by_id and not agent.state.pending


def test_a_pending_part_no_longer_assigned_is_forgotten(tmp_path: Path, process_reaper) -> None:
    agent = _agent(tmp_path)
    old = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-busy", restartable=True))
    _hold(agent, old)
    new = make_spec(attempt_id="att-waiting", attempt_number=2, restartable=True)
    agent.state.launched_at[new.attempt_id] = time.monotonic()
    agent.desired.launch(new, _no_code(agent))
    assert new.attempt_id in agent.state.pending
    agent.state.launched_at.pop(new.attempt_id)
    agent.desired.launch_pending()
    assert not agent.state.pending and new.attempt_id not in agent.state.by_id


def test_a_taken_over_part_keeps_its_memory_tier(tmp_path: Path, sockets: Path, process_reaper) -> None:
    """Finding 5: the new attempt's socket serves the memory tier as a cold start's would."""
    tier = MemoryTier(1 << 20, peer_timeout_s=1)
    api = LocalApi(memory=tier, handovers=Handovers())
    try:
        old_spec = make_spec(attempt_id="att-m1", restartable=True,
                             memory=MemoryTierSpec(secret=secrets.token_hex(32)))
        new_spec = make_spec(attempt_id="att-m2", attempt_number=2, restartable=True, adopts="att-m1",
                             memory=MemoryTierSpec(secret=secrets.token_hex(32)))
        old = _parked_run(tmp_path, process_reaper, old_spec)
        config = AgentConfig(control_plane_url="http://127.0.0.1:9", join_token="j", name="n1", address="127.0.0.2",
                             virtual_gpus=2, work_dir=tmp_path / "agent")
        launches = Parts(config, api, Isolation(pool=None, cgroups=None), structlog.get_logger())
        run = launches.take_over(new_spec, old)
        assert run is not None
        api.reports.register(new_spec.attempt_id, new_spec.fencing_token)
        path = api.socket_of(new_spec.attempt_id)
        assert path is not None
        with httpx.Client(base_url="http://agent", transport=httpx.HTTPTransport(uds=str(path)), timeout=10) as http:
            r = http.get(f"/v1/local/attempts/{new_spec.attempt_id}/{LOCAL_MEMORY_KIND}",
                         headers={TOKEN_HEADER: new_spec.fencing_token})
        assert r.status_code == 200 and r.json()["enabled"] is True, r.text
    finally:
        api.stop()
        tier.stop()


def test_a_chain_of_handovers_closes_every_earlier_socket_and_entry_when_its_last_part_ends(
        tmp_path: Path, process_reaper) -> None:
    """Finding 7: after 1 -> 2 -> 3, attempt 1's socket (a listener thread, a file, a connection slot)
    and its handover entry go with the last part, not never."""
    agent = _agent(tmp_path)
    assert agent.state.parts is not None
    api = agent.state.parts.api
    first = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-c1", restartable=True),
                        attempts=agent.config.work_dir / "attempts")
    api.open(first.attempt_id, agent.state.parts.paths(first.attempt_id, 0).socket or Path())
    _hold(agent, first)
    run = first
    for n in (2, 3):
        agent.state.stop_or_park(run, "peer failed", handover_ok=True)
        spec = make_spec(attempt_id=f"att-c{n}", attempt_number=n, restartable=True, adopts=run.attempt_id)
        agent.state.launched_at[spec.attempt_id] = time.monotonic()
        agent.desired.launch(spec)
        run = agent.state.by_id[spec.attempt_id]
        assert run.pid == first.pid
        agent.state.handovers.register(spec.attempt_id, spec.fencing_token, node_rank=0, nproc=2)
    assert run.handed_over_from() == ["att-c1", "att-c2"]
    assert all(api.socket_of(a) is not None for a in ("att-c1", "att-c2", "att-c3"))
    run.kill_now()
    deadline = time.monotonic() + 10
    while run.alive and time.monotonic() < deadline:
        run.poll()
        time.sleep(0.05)
    run.mark_done()
    agent.supervision._supervise(run, None)
    try:
        assert all(api.socket_of(a) is None for a in ("att-c1", "att-c2", "att-c3"))
    finally:
        api.stop()
    assert all(agent.state.handovers.answer(a, f"fence-{a}", 0, 0.0) is None for a in ("att-c1", "att-c2", "att-c3"))


def test_a_relay_refused_as_stale_asks_the_control_plane_before_stopping_a_part_it_may_hand_over(
        tmp_path: Path, process_reaper) -> None:
    """A worker's upload-slot or shard relay refused because the attempt just failed arrives before
    the stop that allows a handover: a restartable part whose workers all run is not stopped by it
    (that killed the healthy rank the next attempt was to take over); its status report goes out at
    once, and the answer parks or stops it. Any other part is fenced off at once, as before."""
    agent = _agent(tmp_path)
    stale = StaleAttempt("attempt 1 already ended (failed); no upload slot", status=409)
    kept = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-kept", restartable=True))
    _hold(agent, kept)
    agent.relaying.stale(kept.attempt_id, stale)
    assert not kept.stale and not kept.stopping and kept.last_sent_at == float("-inf")
    agent.state.stop_or_park(kept, "the control plane asked", handover_ok=True)  # what the report's answer says
    assert kept.parked and not kept.stopping

    plain = _parked_run(tmp_path, process_reaper, make_spec(attempt_id="att-plain", restartable=True,
                                                            gpu_indices=[0, 1]))
    plain.spec = plain.spec.model_copy(update={"restartable": False})
    _hold(agent, plain)
    agent.relaying.stale(plain.attempt_id, stale)
    assert plain.stale and plain.stopping
