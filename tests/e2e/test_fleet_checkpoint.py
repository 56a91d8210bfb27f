"""The simulated fleet's checkpoint protocol against a real control plane (HTTPS, in a process of its
own as bench/checkpoint_scale.py runs it), so the benchmark's protocol code cannot rot unseen:
2 nodes x 2 ranks save a step rank by rank (slot, grant, presigned PUT, relayed report, release)
and it commits; the per-node batch protocol too where the control plane serves it. No timings."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

from trainyard.dev.fleet import ControlPlane, Endpoints, S3Target
from trainyard.dev.fleet_proc import FleetProcess


def test_fleet_saves_a_step_through_the_checkpoint_protocol(tmp_path: Path, fresh_database_url: str,
                                                             s3_bucket: Any) -> None:
    s3 = S3Target(s3_bucket.endpoint, s3_bucket.access_key, s3_bucket.secret_key, s3_bucket.bucket)
    cp = ControlPlane(fresh_database_url, s3, admin_token=secrets.token_urlsafe(12),
                      join_token=secrets.token_urlsafe(12), log_path=tmp_path / "control-plane.log",
                      env={"TRAINYARD_NODE_LOST_TIMEOUT_S": "60", "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "120"},
                      tls_dir=tmp_path / "tls")
    cp.start()
    fleet = FleetProcess(Endpoints(cp.urls, cp.admin_token, cp.join_token, cp.ca_file),
                         log_path=tmp_path / "fleet.log", gpus_per_node=2)
    try:
        assert cp.url.startswith("https://")
        fleet.start()
        fleet.call("grow", n=2)
        job_id = fleet.call("job", name="ckpt", nodes=2)["job_id"]
        saved = fleet.call("checkpoint", job_id=job_id, attempt=1, step=100, mode="rank", phase="ckpt")
        batched = fleet.call("checkpoint", job_id=job_id, attempt=1, step=200, mode="node", phase="ckpt")
        recovered = fleet.call("fail", job_id=job_id, attempt=1, nodes=2)
        seen = fleet.call("samples")
        # The run can be shorter than one heartbeat interval: wait for the second beat, whenever
        # the interval the control plane asks for brings it.
        deadline = time.monotonic() + 30
        while seen["requests"].get("heartbeat", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            seen = fleet.call("samples")
    finally:
        fleet.stop()
        cp.stop()
    assert saved["committed"] >= saved["last_upload"] > saved["started"] and saved["ranks"] == 4
    requests = saved["requests"]
    assert requests["slot"] >= 4 and requests["grant"] == 4 and requests["release"] == 4
    assert 2 <= requests["shards"] <= 4  # each node's relay sends what is queued: 1 to 2 reports
    if "unavailable" not in batched:  # the per-node batch endpoints (issue 27) exist
        assert batched["committed"] >= batched["last_upload"] and batched["requests"]["grant-batch"] == 2
        assert batched["requests"]["shards"] == 2 and "slot" not in batched["requests"]
    assert recovered["all_s"] >= recovered["first_s"] > 0
    assert seen["error_count"] == 0, seen["errors"]
    assert seen["heartbeats"] and seen["requests"]["heartbeat"] >= 2
