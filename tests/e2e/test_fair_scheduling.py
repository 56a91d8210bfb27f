"""Head-of-line protection end to end: a 2-node job at the head and a stream of 1-GPU jobs on a
3-node cluster (real agents, torchrun workers). The big job gets the nodes that drain soonest and
starts when they have; the small jobs run elsewhere meanwhile; nothing is stopped to make room.
The jobs take steps and train nothing (tests/e2e/steps_job.py): placement is the subject."""

from __future__ import annotations

import pytest

from tests.factories import steps_body

pytestmark = pytest.mark.e2e
ENDED = {"succeeded", "failed", "cancelled"}


def _run(name: str, nodes: int, per: int, steps: int, delay: float, limit: int | None = None) -> dict:
    return steps_body(steps, delay, name=name, num_nodes=nodes, gpus_per_node=per, max_failures=0,
                      time_limit_s=limit)


def _on(job: dict) -> set[str]:
    return {a["node_name"] for a in job["allocation"]}


@pytest.mark.parametrize("cluster", [{"nodes": 3, "gpus_per_node": 2}], indirect=True)
def test_big_job_starts_on_its_reserved_nodes_while_small_jobs_run_elsewhere(cluster):
    # One node (a) runs a 2-GPU job for ~20 s (limit 600 s); another (b) one GPU of a job limited to
    # 240 s. Which nodes they are is the scheduler's choice: placement never depends on names.
    long = cluster.submit(_run("long", 1, 2, steps=50, delay=0.4, limit=600))
    [a] = cluster.wait_for("long placed", lambda: _on(cluster.job(long["id"])), timeout=30)
    short = cluster.submit(_run("short", 1, 1, steps=50, delay=0.4, limit=240))
    [b] = cluster.wait_for("short placed", lambda: _on(cluster.job(short["id"])), timeout=30)
    [c] = {"node-1", "node-2", "node-3"} - {a, b}

    # The big job cannot fit: it holds c (free) and b (short's limit ends first).
    big = cluster.submit(_run("big", 2, 2, steps=20, delay=0.2))
    held = cluster.wait_for("big's reservation", lambda: cluster.job(big["id"])["reservation"], timeout=30)
    assert set(held["nodes"]) == {b, c} and held["earliest_start"] is not None
    small = [cluster.submit(_run(f"small-{i}", 1, 1, steps=25, delay=0.3)) for i in range(3)]

    seen_overlap = False
    big_started_after_short = None
    first_allocation: dict[str, set[str]] = {}

    def observe() -> bool:
        nonlocal seen_overlap, big_started_after_short
        # The small jobs first, then the big one: a big job that has no attempt yet had none when the
        # small ones were read. (Read the other way round, big's last node could be released, and
        # given to a small job, between the two reads, while its view still said "running".)
        jobs = [cluster.job(s["id"]) for s in small]
        big_now = cluster.job(big["id"])
        if big_now["current_attempt"] is None:
            for j in jobs:  # while big waits, small jobs never take its nodes
                assert not (_on(j) & {b, c}), f"{j['name']} took a reserved node: {_on(j)}"
        if big_now["allocation"]:
            # Whole at allocation; at the end its nodes give their GPUs back one by one.
            assert _on(big_now) <= {b, c}
            first_allocation.setdefault("nodes", _on(big_now))
            if big_started_after_short is None:
                big_started_after_short = cluster.job(short["id"])["state"] in ENDED
        if big_now["state"] == "running" and any(j["state"] == "running" and _on(j) == {a} for j in jobs):
            seen_overlap = True  # the small ones keep running elsewhere
        return big_now["state"] in ENDED and all(j["state"] in ENDED for j in jobs)

    cluster.wait_for("every job done", observe, timeout=240, every=0.25)

    everyone = [long, short, big, *small]
    for j in everyone:
        done = cluster.job(j["id"])
        assert done["state"] == "succeeded", (done["name"], done["end_reason"])
        attempts = cluster.get(f"/v1/jobs/{j['id']}/attempts")["items"]
        assert [a["outcome"] for a in attempts] == ["succeeded"], done["name"]  # none stopped, none retried
    assert first_allocation["nodes"] == {b, c}
    assert big_started_after_short, "big started before the node it waited for had drained"
    assert seen_overlap, "no small job ran beside the big one"
    scheduling = cluster.get("/v1/cluster")["scheduling"]
    assert scheduling["reservations_started"] >= 1 and scheduling["reservations_started_on_time"] >= 1
    assert scheduling["reservation_idle_gpu_seconds"] > 0  # c waited idle for b
