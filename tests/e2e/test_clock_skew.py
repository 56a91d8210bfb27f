"""Finding 11: one of two control-plane replicas on one database runs with its wall clock 30 s ahead
(libfaketime; its monotonic clock is left alone). Decisions read the database's clock, so no node
is declared lost early and a time limit is not enforced early."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from tests.factories import steps_body
from tests.helpers import need

pytestmark = pytest.mark.e2e

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW = {"LD_PRELOAD": str(LIBFAKETIME), "FAKETIME": "+30s", "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1"}
TIME_LIMIT_S = 25


def _node_lost_events(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text("SELECT count(*) FROM events WHERE kind = 'node.lost'")).scalar_one())
    finally:
        engine.dispose()


def test_a_replica_30s_ahead_declares_nobody_lost_and_enforces_no_limit_early(make_cluster, fresh_database_url):
    need(LIBFAKETIME.exists() and shutil.which("faketime") is not None,
         "libfaketime is not installed; as root: apt-get install -y faketime")
    ahead = float(subprocess.run([sys.executable, "-c", "import time; print(time.time())"], env={**os.environ, **SKEW},
                                 check=True, capture_output=True, text=True).stdout) - time.time()
    assert 25 < ahead < 35, ahead  # what the replica will see
    # node-1 reports to replica 1, node-2 to the skewed one. A node-lost timeout of 10 s (not the
    # suite's 4 s) still sits far below the 30 s skew, and a loaded test machine's late heartbeat
    # does not pass for what the skew would do (CI once saw "node node-2 lost" at 4 s).
    cluster = make_cluster(nodes=2, replicas=2, settings={"TRAINYARD_NODE_LOST_TIMEOUT_S": "10"})
    cluster.dev.restart_control_plane(replica=1, kill=False, extra_env=SKEW)
    # node-2 could not heartbeat while its replica restarted, so the other replica may rightly have
    # declared it lost: count only what happens once both are back.
    cluster.wait_for("both nodes ready", lambda: all(n["state"] == "ready" for n in cluster.get("/v1/nodes")),
                     timeout=60)
    lost_before = _node_lost_events(fresh_database_url)

    job = cluster.submit(steps_body(100000, 0.05, name="skewed", num_nodes=2, gpus_per_node=1,
                                    time_limit_s=TIME_LIMIT_S, max_failures=0))
    reached = cluster.wait_state(job["id"], {"running", "failed", "succeeded", "cancelled"}, timeout=120)
    assert reached["state"] == "running", reached["end_reason"]  # not "node node-1 lost"
    # Past the skewed replica's startup grace (6 s) and the node-lost timeout (10 s), well inside the
    # time limit: with the replica's wall clock every node would be 30 s silent and the attempt 30 s
    # older than it is.
    watch_until = time.monotonic() + 15
    while time.monotonic() < watch_until:
        assert {n["name"]: n["state"] for n in cluster.get("/v1/nodes")} == {"node-1": "ready", "node-2": "ready"}
        now = cluster.job(job["id"])
        assert now["state"] == "running", (now["state"], now["end_reason"])  # the reason, not a truncated dict
        time.sleep(0.5)
    assert _node_lost_events(fresh_database_url) == lost_before

    done = cluster.wait_state(job["id"], {"failed", "succeeded", "cancelled"}, timeout=120)
    assert done["state"] == "failed" and "time limit" in (done["end_reason"] or ""), done
    (attempt,) = cluster.attempts(job["id"])
    failed_at = datetime.fromisoformat(attempt["failed_at"] if attempt.get("failed_at") else attempt["ended_at"])
    lived = (failed_at - datetime.fromisoformat(attempt["created_at"])).total_seconds()
    assert lived >= TIME_LIMIT_S, attempt  # never early (both instants are the database's)
    assert _node_lost_events(fresh_database_url) == lost_before
