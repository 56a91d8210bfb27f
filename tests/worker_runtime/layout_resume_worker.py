"""Run under torchrun by test_exact_resume.py's layout matrix. For each case of
``LAYOUT_TEST_CASES`` (``{name: {"layout": ..., "resume_from": [step, ...]}}``, JSON), attempts
of the user's job (``train_layout``) under that layout, all in this one launch so that torchrun's
start is paid once: the reference run (saving every 3 steps to S3 through the fake agent), then an
attempt restored from each step of ``resume_from``. Each attempt gets a process group of its own
(a new prefix of one TCPStore) and other global RNG streams, as a new torchrun would give; its
restore plan is built from the shard objects in S3 (the test checks it against the shard reports).
Each case is a job of its own (``<TRAINYARD_JOB_ID>-<name>``; fencing tokens
``tok-<name>-<attempt>``). ``LAYOUT_TEST_NODES`` splits the ranks into that many "nodes" of
consecutive ranks (local rank, local world size, node rank), as the agent's launch would. Rank 0
prints one JSON line: ``{name: {"ranks": [each rank's results of the attempts], "plans": [...]}}``."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from tests.worker_runtime.test_exact_resume import train_layout
from trainyard.protocol.keys import manifest_key, shard_key
from trainyard.protocol.layout import Layout
from trainyard.storage.s3 import S3Config, S3Storage
from worker_runtime import WorkerContext

TIMEOUT = timedelta(seconds=60)


def plan(ctx: WorkerContext, step: int, nodes: int) -> dict[str, Any]:
    """The restore plan the control plane would send: the committed manifest of ``step`` (attempt 0)."""
    assert ctx.checkpoint_prefix is not None
    store = S3Storage(S3Config.from_mapping(ctx.storage))
    shards = []
    for rank in range(ctx.world_size):
        key = shard_key(ctx.checkpoint_prefix, step, 0, rank)
        payload = store.get_bytes(key)
        shards.append({"rank": rank, "key": key, "size_bytes": len(payload),
                       "sha256": hashlib.sha256(payload).hexdigest()})
    return {"candidates": [{
        "format": "trainyard.checkpoint/1", "job_id": ctx.job_id, "checkpoint_id": f"ckpt-{step}", "step": step,
        "attempt_id": "att-0", "attempt_number": 0, "world_size": ctx.world_size,
        "layout": {"num_nodes": nodes, "gpus_per_node": ctx.world_size // nodes},
        "manifest_key": manifest_key(ctx.checkpoint_prefix, step, 0), "shards": shards}]}


def main() -> None:
    base = WorkerContext.from_env()
    nodes = int(os.environ.get("LAYOUT_TEST_NODES", "1"))
    per_node = base.world_size // nodes
    base = dataclasses.replace(base, local_world_size=per_node, local_rank=base.rank % per_node,
                               node_rank=base.rank // per_node, group_rank=base.rank // per_node)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), base.world_size,
                          is_master=base.is_main, timeout=TIMEOUT)
    groups = 0

    def new_group() -> None:  # TrainLoop finds it and destroys it at its end
        nonlocal groups
        groups += 1
        dist.init_process_group("gloo", store=dist.PrefixStore(f"group-{groups}", store), rank=base.rank,
                                world_size=base.world_size, timeout=TIMEOUT)

    mine: dict[str, Any] = {}
    for name, spec in json.loads(os.environ["LAYOUT_TEST_CASES"]).items():
        job = f"{base.job_id}-{name}"
        case = dataclasses.replace(base, job_id=job, checkpoint_prefix=f"jobs/{job}/checkpoints",
                                   layout=Layout.model_validate(spec["layout"]))
        results, plans = [], []
        for attempt, step in enumerate((None, *spec["resume_from"])):
            new_group()
            restore = None
            if step is not None:  # every rank drained its uploads: it is in this group
                restore = plan(case, step, nodes)
                plans.append(restore)
            ctx = dataclasses.replace(case, attempt_id=f"att-{attempt}", attempt_number=attempt,
                                      fencing_token=f"tok-{name}-{attempt}", restore_from=restore)
            with contextlib.redirect_stdout(sys.stderr):  # the loop's result line: stdout is for the summary
                results.append(train_layout(ctx))
        mine[name] = {"results": results, "plans": plans}
    new_group()  # to bring every rank's results to rank 0
    everyone: list[Any] = [None] * base.world_size
    dist.all_gather_object(everyone, mine)
    dist.destroy_process_group()
    if base.is_main:
        print(json.dumps({name: {"ranks": [rank[name]["results"] for rank in everyone], "plans": ran["plans"]}
                          for name, ran in mine.items()}), flush=True)


if __name__ == "__main__":
    main()
