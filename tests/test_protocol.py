"""The wire contract (trainyard/protocol) is one thing: one key layout, one set of names, cheap imports."""

from __future__ import annotations

import subprocess
import sys
import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.services.checkpoints.checkpoints import checkpoint_prefix
from trainyard.protocol import keys
from worker_runtime import WorkerContext
from worker_runtime.checkpoint.manager import CheckpointManager
from worker_runtime.state import TrainState


def test_the_key_layout() -> None:
    # Objects outlive versions: a bucket written by one release is read by the next.
    prefix = keys.job_checkpoint_prefix("j1")
    assert prefix == "jobs/j1/checkpoints"
    assert keys.step_prefix(prefix + "/", 7, 2) == "jobs/j1/checkpoints/step-000000007/attempt-0002"
    assert keys.shard_key(prefix, 7, 2, 13) == "jobs/j1/checkpoints/step-000000007/attempt-0002/rank-00013.pt"
    assert keys.manifest_key(prefix, 7, 2) == "jobs/j1/checkpoints/step-000000007/attempt-0002/manifest.json"


def test_a_workers_shard_key_is_where_the_control_plane_looks() -> None:
    job_id = uuid.uuid4()
    ctx = WorkerContext(job_id=str(job_id), attempt_number=3, rank=1, world_size=2, local_world_size=2,
                        local_rank=1, device="cpu")
    manager = CheckpointManager(ctx, TrainState(), storage=None)
    key = manager.shard_key(40)
    # services/checkpoints/checkpoints.py refuses a shard outside this prefix and deletes a checkpoint by it.
    assert key.startswith(checkpoint_prefix(job_id, 40, 3) + "/")
    assert key == keys.shard_key(keys.job_checkpoint_prefix(job_id), 40, 3, 1)


def test_the_contract_imports_nothing_heavy() -> None:
    code = (
        "import sys\n"
        "import trainyard.protocol.env, trainyard.protocol.keys, trainyard.protocol.storage\n"
        "assert 'pydantic' not in sys.modules, 'env, keys and storage are standard library only'\n"
        "import trainyard.protocol.agent\n"
        "heavy = {'control_plane', 'node_agent', 'worker_runtime', 'sqlalchemy', 'fastapi', 'httpx', 'torch',\n"
        "         'minio', 'psutil'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@settings(max_examples=200, deadline=None)
@given(step=st.integers(0, 10**12), attempt=st.integers(0, 10**6), rank=st.integers(0, 10**7))
def test_parse_key_reads_back_exactly_the_keys_the_layout_spells(step: int, attempt: int, rank: int) -> None:
    """The control plane signs storage URLs only for keys parse_key accepts (issue 11, finding 3)."""
    prefix = keys.job_checkpoint_prefix(uuid.UUID(int=step))
    shard, manifest = keys.shard_key(prefix, step, attempt, rank), keys.manifest_key(prefix, step, attempt)
    assert keys.parse_key(prefix, shard) == keys.CheckpointObject(step, attempt, rank)
    assert keys.parse_key(prefix, manifest) == keys.CheckpointObject(step, attempt, None)
    other = keys.job_checkpoint_prefix(uuid.UUID(int=step + 1))
    for bad in (
        shard.replace(prefix, other),  # another job's
        f"{prefix}/step-{step:09d}/attempt-{attempt:04d}/../../{shard}",  # climbs out
        shard + "x", "/" + shard, shard.replace("rank-", "rank-0"),  # not as the layout spells it
        prefix + "/", prefix, f"{prefix}/step-{step:09d}/",  # prefixes: listings
    ):
        assert keys.parse_key(prefix, bad) is None, bad
