"""Finding 21 (1,000 agents): with a heartbeat interval far longer than the waits below, real agents
on two control-plane replicas still launch a new attempt and stop a cancelled one promptly: the
long poll (POST /v1/agent/wait) wakes them, whichever replica scheduled or cancelled."""

from __future__ import annotations

from tests.factories import steps_body

# Heartbeats every 60 s (jittered down to 48 s): a job that starts, or stops, within 30 s of the
# change was woken, not heartbeat into it.
LONG_INTERVAL = {
    "TRAINYARD_HEARTBEAT_INTERVAL_S": "60",
    "TRAINYARD_HEARTBEAT_INTERVAL_MAX_S": "60",
    "TRAINYARD_NODE_LOST_TIMEOUT_S": "75",
    "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "300",
}
PROMPTLY_S = 30.0


def test_agents_launch_and_stop_through_wake_ups_across_replicas(make_cluster):
    cluster = make_cluster(nodes=2, gpus_per_node=1, replicas=2, settings=LONG_INTERVAL)
    cluster.wait_for("both nodes ready", lambda: len([n for n in cluster.get("/v1/nodes") if n["state"] == "ready"])
                     == 2, timeout=60)
    job = cluster.submit(steps_body(1000000, 0.05, num_nodes=2, gpus_per_node=1))
    # Both agents launch the attempt well before their next heartbeat is due (the interval is 60 s).
    cluster.wait_for("both agents launched the attempt", lambda: all(
        "attempt_launched" in cluster.log_text(n) for n in ("node-1", "node-2")), timeout=PROMPTLY_S)
    cluster.wait_state(job["id"], {"starting", "running", "recovering"}, timeout=5)
    r = cluster.http.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 200, r.text
    # The stop order reaches both agents by a wake-up too; their workers' exit is heartbeat at once.
    cluster.wait_state(job["id"], {"cancelled"}, timeout=PROMPTLY_S)
    cluster.wait_for("leases released", lambda: not [
        g for n in cluster.get("/v1/nodes") for g in n["gpus"] if g["job_id"]], timeout=PROMPTLY_S)
