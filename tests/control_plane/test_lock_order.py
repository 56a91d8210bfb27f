"""Findings 9/18: one lock order for the whole control plane; no deadlock under normal traffic.

A real server (uvicorn in this process, its loops running) on a real Postgres, driven by
simulated agents over HTTP on the same nodes and jobs at once: heartbeats whose confirm-stopped
releases free GPUs, status reports, shard reports, plus scheduling passes, time limits and cancels.
Nothing may answer 5xx (a deadlock surfaces as a 503), and Postgres must count no deadlock.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from control_plane.app import create_app
from control_plane.settings import Settings
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, JOIN_TOKEN, job_body, workers_for

NODES = 6
RUN_S = 20.0


class Failures:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.items: list[str] = []
        self.requests = 0

    def check(self, r: httpx.Response) -> httpx.Response:
        with self.lock:
            self.requests += 1
            if r.status_code >= 500:
                self.items.append(f"{r.request.method} {r.request.url.path}: {r.status_code} {r.text[:300]}")
        return r


def _agent(base: str, name: str, stop: threading.Event, failures: Failures) -> None:
    with httpx.Client(base_url=base, timeout=60) as c:
        reg = failures.check(c.post("/v1/agent/register", headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, json={
            "name": name, "address": "127.0.0.1", "labels": {},
            "gpus": [{"index": i, "uuid": f"{name}-{i}", "kind": "virtual-cpu", "memory_mb": 0} for i in range(2)],
        })).json()
        h = {"Authorization": f"Bearer {reg['node_token']}"}
        seq = 0
        running: dict[str, dict[str, Any]] = {}  # attempt id -> spec
        beats: dict[str, int] = {}
        while not stop.is_set():
            seq += 1
            r = failures.check(c.post("/v1/agent/heartbeat", headers=h, json={
                "agent_instance": "i1", "seq": seq, "attempts": [{"attempt_id": a} for a in running]}))
            if r.status_code != 200:
                continue
            assigned = {s["attempt_id"]: s for s in r.json()["assignments"]}
            for aid in list(running):
                if aid not in assigned:
                    running.pop(aid)  # stopped: the next heartbeat confirms it (releases the GPUs)
            for aid, spec in assigned.items():
                n = beats[aid] = beats.get(aid, 0) + 1
                url = f"/v1/agent/attempts/{aid}/"
                body = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"]}
                if n == 1:
                    running[aid] = spec
                    failures.check(c.post(url + "status", headers=h, json={
                        **body, "state": "running", "workers": workers_for(spec, "running")}))
                elif n == 2:
                    prefix = f"jobs/{spec['job_id']}/checkpoints/step-000000001/attempt-{spec['attempt_number']:04d}"
                    base_rank = spec["node_rank"] * spec["nproc_per_node"]
                    failures.check(c.post(url + "shards", headers=h, json={**body, "shards": [
                        {"rank": base_rank + i, "step": 1, "world_size": spec["nnodes"] * spec["nproc_per_node"],
                         "key": f"{prefix}/rank-{base_rank + i}", "size_bytes": 1, "sha256": "0" * 64}
                        for i in range(spec["nproc_per_node"])]}))
                elif n >= 3 + random.randrange(3):
                    code = random.choice([0, 0, 1])
                    failures.check(c.post(url + "status", headers=h, json={
                        **body, "state": "exited", "exit_code": code, "workers": workers_for(spec, "exited", code)}))
                    running.pop(aid, None)
            time.sleep(random.uniform(0, 0.05))


def _submitter(base: str, stop: threading.Event, failures: Failures) -> None:
    with httpx.Client(base_url=base, timeout=60, headers=ADMIN) as c:
        i = 0
        while not stop.is_set():
            r = failures.check(c.get("/v1/jobs", params={"state": ["queued", "starting", "running", "recovering"]}))
            active = r.json()["items"] if r.status_code == 200 else []
            if len(active) < 8:
                i += 1
                failures.check(c.post("/v1/jobs", json=job_body(
                    name=f"j{i}", num_nodes=random.choice([1, 2, 3]), gpus_per_node=1, max_failures=1,
                    time_limit_s=random.choice([None, None, 1]))))
            if active and random.random() < 0.3:
                failures.check(c.post(f"/v1/jobs/{random.choice(active)['id']}/cancel"))
            time.sleep(random.uniform(0.02, 0.1))


def _deadlocks(database_url: str) -> int:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(
                "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")).scalar_one())
    finally:
        engine.dispose()


def test_agents_scheduler_and_cancels_in_parallel_never_deadlock(settings: Settings) -> None:
    s = settings.model_copy(update={
        "run_loops": True, "scheduler_interval_s": 0.05, "monitor_interval_s": 0.2, "limits_interval_s": 0.1,
        "checkpoint_maintenance_interval_s": 0.2, "node_lost_timeout_s": 60.0,
    })
    before = _deadlocks(s.database_url)
    failures = Failures()
    stop = threading.Event()
    with serve(create_app(s)) as base:
        threads = [threading.Thread(target=_agent, args=(base, f"n{i}", stop, failures)) for i in range(NODES)]
        threads += [threading.Thread(target=_submitter, args=(base, stop, failures)) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(RUN_S)
        stop.set()
        for t in threads:
            t.join(60)
    assert failures.items == [], "\n".join(failures.items[:10])
    assert failures.requests > 200  # it did run
    time.sleep(1.5)  # Postgres publishes its statistics at most once a second
    assert _deadlocks(s.database_url) == before
