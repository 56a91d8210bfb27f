"""Agent lifecycle faults on a real cluster (issue 9, finding 2): a final status that arrives long
after the job's processes ended must still decide the attempt; nothing is declared vanished while
the node lists the attempt."""

from __future__ import annotations

import pytest

from tests.factories import job_body, steps_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


def test_a_final_status_slower_than_the_vanish_timeout_still_succeeds(make_cluster):
    # Every final status takes 20 s to be taken in (a slow final commit), far past the 10 s after
    # which a silent part whose node no longer lists it is declared vanished; the heartbeats go on.
    cluster = make_cluster(nodes=1, settings={"TRAINYARD_FAILPOINTS": "agent.final_status=sleep(20)"})
    job = cluster.submit(steps_body(6, name="slow-final", num_nodes=1, gpus_per_node=1, max_failures=0))
    done = cluster.wait_state(job["id"], ENDED, timeout=180)
    assert done["state"] == "succeeded", done["end_reason"]
    assert cluster.events(job["id"], "attempt.failed") == []


def test_an_attempt_the_node_cannot_create_fails_at_once_with_the_reason(make_cluster):
    # Finding 6: the node's attempts/ directory is a file (as good as a full disk or a permission
    # error for mkdir): the launch failure is reported, and the attempt fails saying why.
    cluster = make_cluster(nodes=1)
    attempts_dir = cluster.dev.config.data_dir / "nodes" / "node-1" / "attempts"
    attempts_dir.rmdir()
    attempts_dir.write_text("not a directory")
    job = cluster.submit(job_body(name="no-dir", num_nodes=1, gpus_per_node=1, max_failures=0))
    done = cluster.wait_state(job["id"], ENDED, timeout=120)
    assert done["state"] == "failed"
    assert "could not create the attempt directory" in done["end_reason"], done["end_reason"]
