"""In-process restart of healthy ranks (worker_runtime/restart.py, trainyard/protocol/restart.py).

The pure parts (fence digests, the next-assignment messages, the memory tier, the failure filter)
are unit tests; one test, for a TrainLoop script (run_restartable) and for a script with its own loop
(tiny_gpt --restartable, through restartable), runs real worker processes over gloo, a real S3 and a
fake agent's local API: a rank crashes, the healthy rank survives in the same process into the next attempt, restores
from its own memory while the replaced rank restores from storage, the job ends with the weights of
a run that never failed, and a worker holding the failed attempt's token is refused at the new
attempt's rendezvous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.conftest import S3Bucket
from tests.helpers import ProcessReaper, free_ports, wait_for
from tests.worker_runtime.fake_agent import FakeAgent, manifest_from_shards
from trainyard.protocol import env as protocol_env
from trainyard.protocol.restart import (
    Assignment,
    NextAssignmentAnswer,
    Rendezvous,
    rendezvous_from_env,
    rendezvous_keyspace,
    rendezvous_verifier,
)
from worker_runtime import WorkerContext
from worker_runtime.checkpoint.kept import KeptSave
from worker_runtime.distributed import StaleRendezvousError
from worker_runtime.restart import (
    AgentAssignments,
    context_for,
    is_peer_failure,
    restartable,
    run_restartable,
)

REPO = Path(__file__).resolve().parents[2]
JOB = "job-restart"
PREFIX = f"jobs/{JOB}/checkpoints"

tokens = st.text(st.characters(codec="ascii", categories=["L", "N"]), min_size=1, max_size=40)


@settings(max_examples=50, deadline=None)
@given(attempt=tokens, token=tokens, other=tokens)
def test_the_fence_is_a_function_of_attempt_and_token_and_hides_the_keyspace(attempt, token, other):
    verifier, keyspace = rendezvous_verifier(attempt, token), rendezvous_keyspace(attempt, token)
    assert verifier == rendezvous_verifier(attempt, token)
    assert keyspace.removeprefix("trainyard/pg/") not in verifier  # the verifier gives no key away
    if other != token:
        assert rendezvous_verifier(attempt, other) != verifier
        assert rendezvous_keyspace(attempt, other) != keyspace
    if other != attempt:
        assert rendezvous_verifier(other, token) != verifier


def test_assignment_messages_refuse_what_cannot_be_joined():
    rdzv = Rendezvous(host="127.0.0.1", port=29500)
    with pytest.raises(ValidationError, match="outside world_size"):
        Assignment(attempt_id="a", attempt_number=1, fencing_token="t", rank=2, world_size=2, node_rank=1,
                   rendezvous=rdzv)
    with pytest.raises(ValidationError, match="assignment comes with state 'assigned'"):
        NextAssignmentAnswer(state="assigned")
    with pytest.raises(ValidationError, match="assignment comes with state 'assigned'"):
        NextAssignmentAnswer(state="stop", assignment=Assignment(
            attempt_id="a", attempt_number=1, fencing_token="t", rank=0, world_size=1, node_rank=0, rendezvous=rdzv))
    assert "secret-t" not in repr(Assignment(attempt_id="a", attempt_number=1, fencing_token="secret-t", rank=0,
                                             world_size=1, node_rank=0, rendezvous=rdzv))  # no token in a log line
    assert rendezvous_from_env(None) is None and rendezvous_from_env(" ") is None
    assert rendezvous_from_env(rdzv.to_env()) == rdzv
    with pytest.raises(ValueError, match="TRAINYARD_RENDEZVOUS is not a valid rendezvous"):
        rendezvous_from_env('{"host": "h", "port": 0}')
    assert protocol_env.ENV_RENDEZVOUS in protocol_env.WORKER_ENV
    ctx = WorkerContext.from_env({"RANK": "1", "WORLD_SIZE": "2", protocol_env.ENV_RENDEZVOUS: rdzv.to_env()})
    assert ctx.rendezvous == rdzv


def test_the_memory_tier_serves_only_its_own_save_rank_and_world_and_never_aliases():
    tier = KeptSave()
    assert tier.get(4, attempt_number=0, rank=0, world_size=2) is None
    tier.keep(4, attempt_number=1, rank=1, world_size=2, state={"model": {"w": torch.ones(3)}})
    assert tier.get(3, attempt_number=1, rank=1, world_size=2) is None  # another step: another state
    assert tier.get(4, attempt_number=0, rank=1, world_size=2) is None  # step 4 as another attempt saved it
    assert tier.get(4, attempt_number=None, rank=1, world_size=2) is None  # a plan that does not say
    assert tier.get(4, attempt_number=1, rank=0, world_size=2) is None  # another rank's per-rank state
    assert tier.get(4, attempt_number=1, rank=1, world_size=3) is None
    got = tier.get(4, attempt_number=1, rank=1, world_size=2)
    assert got is not None and torch.equal(got["model"]["w"], torch.ones(3))
    got["model"]["w"].add_(1)  # an optimizer updating what it loaded in place
    again = tier.get(4, attempt_number=1, rank=1, world_size=2)
    assert again is not None and torch.equal(again["model"]["w"], torch.ones(3))


def test_only_a_peer_failure_restarts_in_place():
    assert is_peer_failure(dist.DistBackendError("boom"))
    assert is_peer_failure(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("a bug in the script"))
    assert not is_peer_failure(StaleRendezvousError("refused"))


def test_a_restarted_context_is_the_new_attempts_and_keeps_its_device():
    old = WorkerContext(job_id=JOB, attempt_id="att-0", attempt_number=0, fencing_token="tok-0", rank=3,
                        world_size=4, local_rank=1, local_world_size=2, node_rank=1, group_rank=1,
                        agent_url="http://agent", agent_socket="/run/a0.sock", device="cpu")
    new = context_for(old, Assignment(attempt_id="att-1", attempt_number=1, fencing_token="tok-1", rank=1,
                                      world_size=4, node_rank=0, rendezvous=Rendezvous(host="10.0.0.2", port=20001),
                                      restore_from={"candidates": []}, agent_socket="/run/a1.sock"))
    assert (new.attempt_id, new.attempt_number, new.fencing_token) == ("att-1", 1, "tok-1")
    assert (new.rank, new.world_size, new.node_rank, new.group_rank) == (1, 4, 0, 0)
    assert (new.local_rank, new.local_world_size, new.device, new.job_id) == (1, 2, "cpu", JOB)
    assert new.rendezvous == Rendezvous(host="10.0.0.2", port=20001) and new.agent_socket == "/run/a1.sock"


def test_the_rendezvous_refuses_a_token_of_another_attempt_before_the_group_exists():
    from datetime import timedelta

    from worker_runtime.distributed import fenced_store

    [port] = free_ports(1)
    rdzv = Rendezvous(host="127.0.0.1", port=port)
    host = WorkerContext(attempt_id="att-1", fencing_token="tok-1", rank=0, world_size=2, device="cpu",
                         rendezvous=rdzv)
    store = fenced_store(host, timeout=timedelta(seconds=10))  # rank 0 hosts it and publishes the verifier
    for attempt, token in (("att-0", "tok-0"), ("att-1", "tok-0"), ("att-0", "tok-1")):
        stale = WorkerContext(attempt_id=attempt, fencing_token=token, rank=1, world_size=2, device="cpu",
                              rendezvous=rdzv)
        with pytest.raises(StaleRendezvousError, match="refused"):
            fenced_store(stale, timeout=timedelta(seconds=10))
    member = fenced_store(WorkerContext(attempt_id="att-1", fencing_token="tok-1", rank=1, world_size=2,
                                        device="cpu", rendezvous=rdzv), timeout=timedelta(seconds=10))
    member.set("k", "v")  # the group's keys: under the token's keyspace, which the verifier does not name
    raw = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert raw.get(rendezvous_keyspace("att-1", "tok-1") + "/k") == b"v" and store.get("k") == b"v"
    assert not raw.check([rendezvous_keyspace("att-0", "tok-0") + "/k"])


class _Source:
    """Hands out the assignments it holds, in order, and records who asked."""

    def __init__(self, *answers: Assignment | None) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[str, str]] = []

    def next_assignment(self, ctx: WorkerContext, wait_s: float) -> Assignment | None:
        self.asked.append((ctx.attempt_id, ctx.fencing_token))
        return self.answers.pop(0) if self.answers else None


def _assignment(attempt: int, **more: Any) -> Assignment:
    return Assignment(attempt_id=f"att-{attempt}", attempt_number=attempt, fencing_token=f"tok-{attempt}", rank=0,
                      world_size=1, node_rank=0, rendezvous=Rendezvous(host="127.0.0.1", port=free_ports(1)[0]),
                      **more)


def test_without_a_handover_the_original_error_ends_the_process_and_script_errors_never_restart(capsys):
    ctx = WorkerContext(job_id=JOB, attempt_id="att-0", fencing_token="tok-0", device="cpu")
    calls: list[str] = []

    def peer_fails(loop: Any) -> None:
        calls.append(loop.ctx.attempt_id)
        raise dist.DistBackendError("Connection closed by peer")

    source = _Source(None)
    with pytest.raises(dist.DistBackendError, match="Connection closed by peer"):
        run_restartable(peer_fails, assignments=source, ctx=ctx, total_steps=3)
    assert calls == ["att-0"] and source.asked == [("att-0", "tok-0")]  # asked with the failed attempt's token

    def script_bug(loop: Any) -> None:
        raise ValueError("a bug in the script")

    source = _Source(_assignment(1))
    with pytest.raises(ValueError, match="a bug in the script"):
        run_restartable(script_bug, assignments=source, ctx=ctx, total_steps=3)
    assert source.asked == []  # never parked: its own error is not a peer's failure

    calls.clear()
    source = _Source(Assignment(attempt_id="att-0", attempt_number=0, fencing_token="tok-0", rank=0, world_size=1,
                                node_rank=0, rendezvous=Rendezvous(host="127.0.0.1", port=1)))
    with pytest.raises(dist.DistBackendError):  # an "assignment" to the failed attempt itself is no handover
        run_restartable(peer_fails, assignments=source, ctx=ctx, total_steps=3)
    assert calls == ["att-0"]


def test_a_handed_over_rank_runs_again_as_the_new_attempts(capsys):
    ctx = WorkerContext(job_id=JOB, attempt_id="att-0", fencing_token="tok-0", device="cpu")
    seen: list[tuple[str, int, int]] = []

    def train(loop: Any) -> str:
        seen.append((loop.ctx.attempt_id, loop.ctx.attempt_number, loop.restarts))
        if loop.ctx.attempt_number < 2:
            raise dist.DistBackendError("Connection reset by peer")
        return loop.ctx.fencing_token

    source = _Source(_assignment(1), _assignment(2))
    assert run_restartable(train, assignments=source, ctx=ctx, total_steps=3) == "tok-2"
    assert seen == [("att-0", 0, 0), ("att-1", 1, 1), ("att-2", 2, 2)]
    assert source.asked == [("att-0", "tok-0"), ("att-1", "tok-1")]  # each time with the attempt it left
    assert "restarting in process as rank 0/1 of attempt att-2" in capsys.readouterr().err


def test_any_attempt_function_restarts_with_the_new_context_and_one_memory_across_attempts(capsys):
    ctx = WorkerContext(job_id=JOB, attempt_id="att-0", fencing_token="tok-0", device="cpu")
    seen: list[tuple[str, int]] = []

    def attempt(ctx: WorkerContext, memory: KeptSave) -> str:
        seen.append((ctx.attempt_id, id(memory)))
        if ctx.attempt_number < 2:
            raise dist.DistBackendError("Connection reset by peer")
        return ctx.fencing_token

    source = _Source(_assignment(1), _assignment(2))
    assert restartable(attempt, assignments=source, ctx=ctx) == "tok-2"
    assert [a for a, _ in seen] == ["att-0", "att-1", "att-2"]
    assert len({m for _, m in seen}) == 1  # the saves of one attempt serve the restore of the next
    assert source.asked == [("att-0", "tok-0"), ("att-1", "tok-1")]


def test_the_agent_client_takes_an_assignment_only_from_an_answer_that_gives_one(fake_agent: FakeAgent):
    ctx = WorkerContext(job_id=JOB, attempt_id="att-0", fencing_token="tok-0", agent_url=fake_agent.url, device="cpu")
    client = AgentAssignments(poll_s=0.2)
    assert client.next_assignment(ctx, wait_s=0.5) is None  # only "waiting" until it gave up
    assert len(fake_agent.of("next-assignment")) >= 2
    fake_agent.handover["tok-0"] = {"state": "stop", "reason": "stopped instead"}
    assert client.next_assignment(ctx, wait_s=5) is None
    fake_agent.statuses["next-assignment"] = [404]  # an agent that offers no handover
    fake_agent.handover["tok-0"] = NextAssignmentAnswer(state="assigned", assignment=_assignment(1)).model_dump()
    assert client.next_assignment(ctx, wait_s=5) is None
    got = client.next_assignment(ctx, wait_s=5)
    assert got is not None and (got.attempt_id, got.fencing_token) == ("att-1", "tok-1")
    assert {r.body["fencing_token"] for r in fake_agent.of("next-assignment")} == {"tok-0"}
    assert AgentAssignments().next_assignment(WorkerContext(device="cpu"), wait_s=5) is None  # no agent at all


# --- real processes ---


def _env(*, attempt: int, rank: int, port: int, agent: FakeAgent | None, bucket: S3Bucket | None,
         restore_from: dict[str, Any] | None = None, token: str | None = None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.update({
        protocol_env.ENV_JOB_ID: JOB, protocol_env.ENV_ATTEMPT_ID: f"att-{attempt}",
        protocol_env.ENV_ATTEMPT_NUMBER: str(attempt), protocol_env.ENV_FENCING_TOKEN: token or f"tok-{attempt}",
        protocol_env.ENV_NODE_RANK: str(rank), protocol_env.ENV_DEVICE: "cpu",
        protocol_env.ENV_RENDEZVOUS: Rendezvous(host="127.0.0.1", port=port).to_env(),
        **extra,
    })
    if agent is not None and bucket is not None:
        env.update({
            protocol_env.ENV_AGENT_URL: agent.url, protocol_env.ENV_CHECKPOINT: json.dumps({"interval_steps": 3}),
            protocol_env.ENV_S3_ENDPOINT: bucket.endpoint, protocol_env.ENV_S3_ACCESS_KEY: bucket.access_key,
            protocol_env.ENV_S3_SECRET_KEY: bucket.secret_key, protocol_env.ENV_S3_BUCKET: bucket.bucket,
            protocol_env.ENV_S3_SECURE: "0", protocol_env.ENV_CHECKPOINT_PREFIX: PREFIX,
        })
    if restore_from is not None:
        env[protocol_env.ENV_RESTORE_FROM] = json.dumps(restore_from)
    return env


# The two ways a script restarts in process: a TrainLoop body in run_restartable (restart_worker.py), and
# a script with its own loop in restartable (tiny_gpt --restartable). Attempts are numbered from 1, as
# Trainyard numbers them (tiny_gpt's --crash-once crashes in attempt 1 only).
SCRIPTS = {
    "run_restartable": ["-m", "tests.worker_runtime.restart_worker"],
    # Steps paced so that step 6's upload is reported before rank 1 crashes at step 8.
    "tiny_gpt": ["-m", "worker_runtime.examples.tiny_gpt", "--steps", "10", "--log-every", "5", "--restartable",
                 "--step-delay-s", "0.25", "--crash-at-step", "8", "--crash-rank", "1", "--crash-kill",
                 "--crash-once"],
}
TINY_GPT_REFERENCE = ["-m", "worker_runtime.examples.tiny_gpt", "--steps", "10", "--log-every", "5"]


def _spawn(reaper: ProcessReaper, env: dict[str, str], argv: list[str]) -> subprocess.Popen[str]:
    return reaper.spawn([sys.executable, *argv], cwd=REPO, env=env,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen[str]) -> tuple[dict[str, Any] | None, str]:
    """The JSON result line the process printed (restart_worker: ``RESULT {...}`` on every rank;
    tiny_gpt: ``{...}`` on rank 0 only), or None; and its stderr."""
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{stdout}\n{stderr}"
    lines = stdout.splitlines()
    prefix = "RESULT " if any(line.startswith("RESULT ") for line in lines) else "{"  # TrainLoop prints its own {...}
    lines = [line.removeprefix("RESULT ") for line in lines if line.startswith(prefix)]
    assert len(lines) <= 1, stdout
    return (json.loads(lines[0]) if lines else None), stderr


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_healthy_rank_restarts_in_process_and_a_stale_worker_is_refused(
        script: str, s3_bucket: S3Bucket, fake_agent: FakeAgent, process_reaper: ProcessReaper) -> None:
    argv, tiny = SCRIPTS[script], script == "tiny_gpt"
    ref_port, port1, port2 = free_ports(3)
    # The run that never fails (no agent, no checkpoints), over the same fenced rendezvous; tiny_gpt's is
    # a plain run without --restartable, so the flag is shown to change nothing in the weights.
    reference = [_result(p)[0] for p in [_spawn(process_reaper, _env(attempt=9, rank=r, port=ref_port, agent=None,
                                                                     bucket=None), TINY_GPT_REFERENCE if tiny else argv)
                                         for r in (0, 1)]]
    ref_sha = reference[0]["weights_sha256"] if tiny else reference[0]["sha"]  # type: ignore[index]
    if not tiny:
        assert reference[0]["sha"] == reference[1]["sha"] and reference[0]["restored"] is None  # type: ignore[index]

    # Attempt 1: rank 1 crashes at step 8 (before its work: restart_worker; after it: tiny_gpt);
    # checkpoints of steps 3 and 6 are saved.
    healthy = _spawn(process_reaper, _env(attempt=1, rank=0, port=port1, agent=fake_agent, bucket=s3_bucket), argv)
    crashing = _spawn(process_reaper, _env(attempt=1, rank=1, port=port1, agent=fake_agent, bucket=s3_bucket,
                                           DIE_AT_STEP="8"), argv)
    assert crashing.wait(timeout=120) == (-9 if tiny else 3)
    # The healthy rank does not exit: it parks and asks its agent, with attempt 1's token.
    wait_for(lambda: fake_agent.of("next-assignment"), timeout=90, what="the healthy rank to ask for a handover")
    assert healthy.poll() is None
    asked = fake_agent.of("next-assignment")
    assert {r.path for r in asked} == {"/v1/local/attempts/att-1/next-assignment"}
    assert {r.body["fencing_token"] for r in asked} == {"tok-1"}
    plan = {"candidates": [manifest_from_shards(fake_agent.shards(), job_id=JOB, attempt_id="att-1",
                                                attempt_number=1, step=6, world_size=2)]}

    # Attempt 2 on a new port: the healthy rank is handed its part; rank 1 is replaced (a fresh process,
    # with the same arguments: tiny_gpt's --crash-once does not crash it again).
    assignment = Assignment(attempt_id="att-2", attempt_number=2, fencing_token="tok-2", rank=0, world_size=2,
                            node_rank=0, rendezvous=Rendezvous(host="127.0.0.1", port=port2), restore_from=plan)
    # A worker of the failed attempt that learned the new rendezvous, holding attempt 1's token.
    stale = _spawn(process_reaper, _env(attempt=1, rank=1, port=port2, agent=None, bucket=None), argv)
    with fake_agent._cond:
        fake_agent.handover["tok-1"] = NextAssignmentAnswer(state="assigned", assignment=assignment).model_dump()
    # Attempt 2's store is up (the survivor holds it, waiting for rank 1) until its rank 1 joins: the
    # stale worker is refused there before the replacement starts. Started after it, a stale worker
    # still importing torch could find attempt 2 over and its store gone, and wait for a server.
    stale_out, stale_err = stale.communicate(timeout=120)
    assert stale.returncode != 0 and "StaleRendezvousError" in stale_err, stale_err
    assert "refused" in stale_err and "RESULT" not in stale_out and "{" not in stale_out
    replaced = _spawn(process_reaper, _env(attempt=2, rank=1, port=port2, agent=fake_agent, bucket=s3_bucket,
                                           restore_from=plan), argv)
    (survivor, survivor_err), (fresh, _) = _result(healthy), _result(replaced)

    assert "restarting in process as rank 0/2 of attempt att-2" in survivor_err
    assert survivor is not None
    if tiny:  # rank 0 alone prints the result; it names the tier that served each rank's restore
        assert fresh is None
        assert survivor["restored_from_step"] == 6 and survivor["restored_tiers"] == {"process": [0], "s3": [1]}
        assert survivor["weights_sha256"] == ref_sha and survivor["steps"] == 10
    else:
        assert fresh is not None
        assert survivor["pid"] == healthy.pid and survivor["restarts"] == 1 and survivor["attempt"] == "att-2"
        assert (survivor["restored"], survivor["from"]) == (6, "memory")
        assert (fresh["restored"], fresh["from"], fresh["restarts"]) == (6, "storage", 0)
        assert survivor["sha"] == fresh["sha"] == ref_sha
        assert survivor["steps"] == fresh["steps"] == reference[0]["steps"]  # type: ignore[index]

