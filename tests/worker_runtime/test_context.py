from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainyard.protocol import env as protocol_env
from worker_runtime import WorkerContext
from worker_runtime import context as wr_context

FULL_ENV = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "TRAINYARD_JOB_ID": "job-1",
    "TRAINYARD_JOB_NAME": "tiny",
    "TRAINYARD_ATTEMPT_ID": "att-3",
    "TRAINYARD_ATTEMPT_NUMBER": "2",
    "TRAINYARD_FENCING_TOKEN": "tok",
    "TRAINYARD_AGENT_URL": "http://10.0.0.2:7070/",
    "TRAINYARD_NODE_RANK": "0",
    "TRAINYARD_DEVICE": "cpu",
    "TRAINYARD_CHECKPOINT": json.dumps({"every_steps": 50}),
    "TRAINYARD_RESTORE_FROM": json.dumps({"step": 100, "prefix": "ckpt/100"}),
}


def test_worker_runtime_reads_the_contracts_names() -> None:
    # One definition: worker_runtime imports the names from trainyard.protocol.env, never retypes them.
    ours = {k: v for k, v in vars(wr_context).items() if k.startswith("ENV_") and v.startswith(protocol_env.PREFIX)}
    assert ours and all(getattr(protocol_env, k) is v for k, v in ours.items())
    assert set(protocol_env.STORAGE_ENV.values()) | set(ours.values()) <= protocol_env.WORKER_ENV


def test_the_launchers_env_round_trips_through_the_worker_context(tmp_path: Path) -> None:
    """What node_agent/part/commands.py gives a worker is what worker_runtime/context.py reads."""
    from node_agent.part.commands import AttemptPaths, NodeContext, worker_env
    from tests.node_agent.helpers import make_spec
    from trainyard.protocol.agent import RestoreCandidate, RestorePlan
    from trainyard.protocol.keys import job_checkpoint_prefix, manifest_key

    prefix = job_checkpoint_prefix("job-7")
    plan = RestorePlan(candidates=[RestoreCandidate(checkpoint_id="c1", step=40, attempt_number=2, world_size=4,
                                                    manifest_key=manifest_key(prefix, 40, 2))])
    storage = {"access": "presigned", "prefix": prefix}
    spec = make_spec(job_id="job-7", job_name="seven", attempt_number=3, node_rank=1, nnodes=2,
                     checkpoint={"interval_steps": 20}, restore_from=plan, storage=storage)
    node = NodeContext(local_addr="127.0.0.2", agent_url="http://127.0.0.1:7070/", virtual=True, base_env={},
                       node_name="n1")
    env = worker_env(spec, node, AttemptPaths(tmp_path))
    assert {k for k in env if k.startswith(protocol_env.PREFIX)} <= protocol_env.WORKER_ENV
    # torchrun adds the ranks.
    ctx = WorkerContext.from_env({**env, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                                  "GROUP_RANK": "1"})
    assert (ctx.job_id, ctx.job_name, ctx.attempt_id, ctx.attempt_number) == ("job-7", "seven", spec.attempt_id, 3)
    assert ctx.fencing_token == spec.fencing_token and ctx.agent_url == "http://127.0.0.1:7070"
    assert (ctx.node_rank, ctx.device, ctx.checkpoint) == (1, "cpu", {"interval_steps": 20})
    assert ctx.restore_from == plan.model_dump(mode="json")
    assert ctx.storage == {"access": "presigned"}
    assert ctx.checkpoint_prefix == prefix


def test_reads_checkpoint_storage() -> None:
    env = {
        **_cpu(),
        "TRAINYARD_S3_ENDPOINT": "127.0.0.1:8333",
        "TRAINYARD_S3_ACCESS_KEY": "ak",
        "TRAINYARD_S3_SECRET_KEY": "very-secret",
        "TRAINYARD_S3_BUCKET": "ckpts",
        "TRAINYARD_S3_SECURE": "0",
        "TRAINYARD_CHECKPOINT_PREFIX": "jobs/job-1/checkpoints/",
    }
    ctx = WorkerContext.from_env(env)
    assert ctx.storage == {"endpoint": "127.0.0.1:8333", "access_key": "ak", "secret_key": "very-secret",
                           "bucket": "ckpts", "secure": "0"}
    assert ctx.checkpoint_prefix == "jobs/job-1/checkpoints"
    assert "very-secret" not in repr(ctx)
    bare = WorkerContext.from_env(_cpu())
    assert bare.storage == {} and bare.checkpoint_prefix is None


def test_standalone_defaults() -> None:
    ctx = WorkerContext.from_env({"TRAINYARD_DEVICE": "cpu"})
    assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.local_world_size) == (0, 0, 1, 1)
    assert ctx.agent_url is None and not ctx.managed and ctx.is_main
    assert ctx.checkpoint == {} and ctx.restore_from is None
    assert ctx.attempt_number == 0 and ctx.fencing_token == ""


def test_standalone_device_follows_the_machine() -> None:
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert WorkerContext.from_env({}).device == expected


def test_reads_torchrun_and_trainyard_variables() -> None:
    ctx = WorkerContext.from_env(FULL_ENV)
    assert ctx.rank == 5 and ctx.local_rank == 1 and ctx.world_size == 8 and ctx.local_world_size == 4
    assert ctx.group_rank == 1 and ctx.node_rank == 0  # c10d (another launcher) may reorder nodes
    assert (ctx.job_id, ctx.job_name, ctx.attempt_id, ctx.attempt_number) == ("job-1", "tiny", "att-3", 2)
    assert ctx.fencing_token == "tok"
    assert ctx.agent_url == "http://10.0.0.2:7070"
    assert ctx.device == "cpu"
    assert ctx.checkpoint == {"every_steps": 50}
    assert ctx.restore_from == {"step": 100, "prefix": "ckpt/100"}
    assert ctx.managed and not ctx.is_main


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FULL_ENV.items():
        monkeypatch.setenv(name, value)
    assert WorkerContext.from_env() == WorkerContext.from_env(FULL_ENV)


def test_node_ranks_fall_back_on_each_other() -> None:
    assert WorkerContext.from_env({**_cpu(), "GROUP_RANK": "2", "WORLD_SIZE": "4"}).node_rank == 2
    ctx = WorkerContext.from_env({**_cpu(), "TRAINYARD_NODE_RANK": "3", "WORLD_SIZE": "4"})
    assert (ctx.node_rank, ctx.group_rank) == (3, 3)


def test_restore_from_null_means_none() -> None:
    assert WorkerContext.from_env({**_cpu(), "TRAINYARD_RESTORE_FROM": "null"}).restore_from is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "one"}, "RANK='one' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "outside world_size"),
        ({"LOCAL_RANK": "1"}, "outside local_world_size"),
        ({"TRAINYARD_DEVICE": "tpu"}, "TRAINYARD_DEVICE"),
        ({"TRAINYARD_CHECKPOINT": "[1, 2]"}, "must be a JSON object"),
        ({"TRAINYARD_RESTORE_FROM": "{"}, "not valid JSON"),
        ({"TRAINYARD_AGENT_URL": "http://x", "TRAINYARD_ATTEMPT_ID": "a"}, "fencing_token"),
        ({"TRAINYARD_AGENT_URL": "http://x", "TRAINYARD_FENCING_TOKEN": "t"}, "TRAINYARD_ATTEMPT_ID"),
    ],
)
def test_rejects_inconsistent_environment(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WorkerContext.from_env({**_cpu(), **env})


def test_is_frozen() -> None:
    ctx = WorkerContext()
    with pytest.raises(AttributeError):
        ctx.rank = 1  # type: ignore[misc]


def _cpu() -> dict[str, str]:
    return {"TRAINYARD_DEVICE": "cpu"}


def test_the_repr_never_shows_the_fencing_token() -> None:
    """Issue 11, finding 13: a context printed or logged must not leak the attempt's secret."""
    secret = "f3nc1ng-s3cr3t-token"
    ctx = WorkerContext(attempt_id="a1", fencing_token=secret, agent_url="http://127.0.0.1:1")
    assert secret not in repr(ctx) and secret not in str(ctx)
    assert "a1" in repr(ctx) and ctx.fencing_token == secret
