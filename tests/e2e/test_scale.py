"""The small version of bench/scale.py (finding 21): 64 simulated agents speaking the agent protocol
over HTTP to a real control plane (subprocess) on real PostgreSQL and S3; a 256-rank job goes
through a checkpoint, a rank failure and its recovery. Asserts protocol properties, never timings:
a node's steady heartbeat does not grow with the job's world size or arguments, credentials are
not in heartbeats, the checkpoint commits, the recovery attempt reaches every node."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path
from typing import Any

from trainyard.dev.fleet import ControlPlane, Fleet, JobFigures, S3Target, job_scenario


async def _run(cp: ControlPlane, s3: S3Target) -> tuple[JobFigures, JobFigures, Fleet]:
    fleet = Fleet(cp, s3, gpus_per_node=4)
    try:
        await fleet.grow(64)
        small = await job_scenario(fleet, 8, window_s=2.0)
        big = await job_scenario(fleet, 256, window_s=2.0, args_size=20_000)
    finally:
        await fleet.close()
    return small, big, fleet


def test_64_agents_256_ranks_checkpoint_failure_recovery(tmp_path: Path, fresh_database_url: str,
                                                        s3_bucket: Any) -> None:
    s3 = S3Target(s3_bucket.endpoint, s3_bucket.access_key, s3_bucket.secret_key, s3_bucket.bucket)
    cp = ControlPlane(fresh_database_url, s3, admin_token=secrets.token_urlsafe(12),
                      join_token=secrets.token_urlsafe(12), log_path=tmp_path / "control-plane.log",
                      env={"TRAINYARD_NODE_LOST_TIMEOUT_S": "60",  # a loaded test machine loses nobody
                           "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "120"})
    cp.start()
    try:
        small, big, fleet = asyncio.run(_run(cp, s3))
    finally:
        cp.stop()
    assert fleet.errors == []  # no 4xx: the agents spoke the protocol right (5xx under load are retried)
    for figures, nodes in ((small, 2), (big, 64)):
        assert figures.extra["steady_full_specs"] == 0  # nothing resent once held
        assert 0 < figures.steady_bytes < 512
        assert figures.legacy_steady_bytes >= figures.first_bytes > figures.steady_bytes  # the baseline
        assert figures.extra["recovered_attempt"] == 2 and figures.extra["recovered_nodes"] == nodes
        assert figures.commit_s > 0
    # A node's steady heartbeat is the same size for 8 ranks and for 256 ranks with 20 kB of args.
    assert big.steady_bytes == small.steady_bytes
    assert big.first_bytes > small.first_bytes + 20_000
    # Agents learn at registration that storage exists (workers get presigned URLs), never its keys.
    agent = fleet.agents[0]
    assert agent.storage == {"access": "presigned"}
    for a in fleet.agents:
        for run in a.runs.values():
            assert set(run.spec["storage"]) == {"prefix"}
