"""Followed logs hold no thread and no database connection while they wait (issue 11, finding 8):
more followers than the replica has threads and pooled connections, on a real server and a real
PostgreSQL, and heartbeats are still answered; followers past a principal's cap get 429; a
follower that goes away is noticed."""

from __future__ import annotations

import threading
import time

import httpx

from control_plane.app import create_app
from control_plane.settings import Settings
from tests.control_plane.helpers import serve
from tests.factories import ADMIN, JOIN_TOKEN, job_body, register_body

THREADS = 4
FOLLOWERS = 24  # > the threads (4) and the whole pool (4 + the loops' 6 + 1, + 10 + 1 answer thread's overflow)


def _follow(server: str, job_id: str, opened: threading.Semaphore, stop: threading.Event) -> None:
    with httpx.Client(base_url=server, timeout=60) as c, \
            c.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, headers=ADMIN) as r:
        assert r.status_code == 200
        opened.release()
        stop.wait(120)


def test_followers_beyond_the_pool_do_not_stall_heartbeats(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"api_threads": THREADS, "agent_wait_threads": 1,
                                                 "log_followers_per_principal": 100, "log_follow_poll_s": 0.2}))
    pool = app.state.engine.pool
    assert pool.size() + pool._max_overflow < FOLLOWERS
    with serve(app) as server, httpx.Client(base_url=server, timeout=30) as c:
        reg = c.post("/v1/agent/register", json=register_body("node-1", 1),
                     headers={"Authorization": f"Bearer {JOIN_TOKEN}"}).json()
        job = c.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
        opened, stop = threading.Semaphore(0), threading.Event()
        threads = [threading.Thread(target=_follow, args=(server, job["id"], opened, stop), daemon=True)
                   for _ in range(FOLLOWERS)]
        for t in threads:
            t.start()
        try:
            for _ in range(FOLLOWERS):
                assert opened.acquire(timeout=60), "a follower was not answered"
            assert app.state.log_followers.held("admin") == FOLLOWERS
            node = {"Authorization": f"Bearer {reg['node_token']}"}
            # The timeout only tells a hang from an answer (the old follower slept in a request
            # thread: 4 followers took every thread and no heartbeat was ever answered).
            for seq in range(1, 6):
                r = c.post("/v1/agent/heartbeat", json={"agent_instance": "a", "seq": seq}, headers=node,
                           timeout=20)
                assert r.status_code == 200, r.text
            assert c.get(f"/v1/jobs/{job['id']}", headers=ADMIN, timeout=20).status_code == 200
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        # The followers went away: each is noticed at its next wait, and releases its place.
        deadline = time.monotonic() + 30
        while app.state.log_followers.held("admin"):
            assert time.monotonic() < deadline, app.state.log_followers.held("admin")
            time.sleep(0.1)


def test_followers_past_the_cap_are_429(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"log_followers_per_principal": 2, "log_follow_poll_s": 0.2}))
    with serve(app) as server, httpx.Client(base_url=server, timeout=30) as c:
        c.post("/v1/agent/register", json=register_body("node-1", 1), headers={"Authorization": f"Bearer {JOIN_TOKEN}"})
        job = c.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
        opened, stop = threading.Semaphore(0), threading.Event()
        threads = [threading.Thread(target=_follow, args=(server, job["id"], opened, stop), daemon=True)
                   for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for _ in range(2):
                assert opened.acquire(timeout=30)
            r = c.get(f"/v1/jobs/{job['id']}/logs", params={"follow": "true"}, headers=ADMIN)
            assert r.status_code == 429 and r.headers["retry-after"]
            assert r.headers["content-type"].startswith("application/problem+json")
            assert c.get(f"/v1/jobs/{job['id']}/logs", headers=ADMIN).status_code == 200  # not following: fine
        finally:
            stop.set()
            for t in threads:
                t.join(30)
