"""Finding 21 (1,000 agents): ``POST /v1/agent/wait`` is a long poll that returns as soon as the
node's desired state changes, also when the change is made by another control-plane replica (its
NOTIFY reaches this one's listener), and "nothing changed" after its timeout. It holds no thread and
no connection while it waits, is bounded per replica (503 + Retry-After), and never answers 500."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from control_plane.app import create_app
from control_plane.settings import Settings
from tests.control_plane.helpers import running, serve
from tests.factories import ADMIN, JOIN_TOKEN, job_body
from trainyard.embedded import free_port

PROMPTLY_S = 15.0  # generous for a loaded machine; a wait that is never woken takes 60 s here


def _register(c: httpx.Client, name: str) -> dict[str, str]:
    r = c.post("/v1/agent/register", headers={"Authorization": f"Bearer {JOIN_TOKEN}"}, json={
        "name": name, "address": "127.0.0.1",
        "gpus": [{"index": 0, "uuid": f"{name}-0", "kind": "virtual-cpu", "memory_mb": 0}], "labels": {},
    })
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['node_token']}"}


def _heartbeat(c: httpx.Client, auth: dict[str, str], seq: int, known: list[dict[str, str]]) -> dict[str, Any]:
    r = c.post("/v1/agent/heartbeat", headers=auth,
               json={"agent_instance": "i1", "seq": seq, "attempts": [], "known": known})
    assert r.status_code == 200, r.text
    return r.json()


class _Wait(threading.Thread):
    """One long poll in the background; ``result``: (status, body, seconds it took)."""

    def __init__(self, base: str, auth: dict[str, str], known: list[dict[str, str]], timeout_s: float,
                 answer: bool = False) -> None:
        super().__init__(daemon=True)
        self.args_ = (base, auth, known, timeout_s, answer)
        self.result: tuple[int, dict[str, Any], float] | None = None

    def run(self) -> None:
        base, auth, known, timeout_s, answer = self.args_
        started = time.monotonic()
        with httpx.Client(base_url=base, timeout=timeout_s + 30) as c:
            r = c.post("/v1/agent/wait", headers=auth, json={"known": known, "timeout_s": timeout_s,
                                                            "answer": answer})
        self.result = (r.status_code, r.json(), time.monotonic() - started)


def _waiting(app: Any, n: int = 1) -> None:
    deadline = time.monotonic() + PROMPTLY_S
    while app.state.wakeups.waiting < n:
        assert time.monotonic() < deadline, "the long poll was never registered"
        time.sleep(0.02)


def test_wait_returns_when_another_replica_assigns_or_stops_and_times_out_otherwise(settings: Settings) -> None:
    a, b = create_app(settings), create_app(settings)  # two replicas, one database
    with serve(a) as url_a, serve(b) as url_b, httpx.Client(base_url=url_a, timeout=30) as ca, \
            httpx.Client(base_url=url_b, timeout=30) as cb:
        auth = _register(ca, "lp-1")
        assert _heartbeat(ca, auth, 1, [])["assignments"] == []

        # Nothing changes: "nothing changed" once its timeout is over.
        idle = _Wait(url_a, auth, [], timeout_s=1.0)
        idle.start()
        idle.join(PROMPTLY_S)
        assert idle.result is not None and idle.result[:2] == (200, {"changed": False})

        # A new attempt, allocated by a scheduling pass of replica B, wakes a wait held by replica A.
        waiter = _Wait(url_a, auth, [], timeout_s=60.0)
        waiter.start()
        _waiting(a)
        r = cb.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN)
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
        assert waiter.result is None  # a submitted job is no assignment yet
        assert b.state.loops.schedule_once() == 1
        waiter.join(PROMPTLY_S)
        assert waiter.result is not None, "the wait on replica A was not woken by replica B's allocation"
        assert waiter.result[:2] == (200, {"changed": True})
        spec = _heartbeat(ca, auth, 2, [])["assignments"][0]
        known = [{"attempt_id": spec["attempt_id"], "version": spec["version"]}]

        # Holding the spec, the agent's wait returns only on a change: the job's cancel on B.
        stop = _Wait(url_a, auth, known, timeout_s=60.0)
        stop.start()
        _waiting(a)
        time.sleep(0.3)
        assert stop.result is None
        assert cb.post(f"/v1/jobs/{job_id}/cancel", headers=ADMIN).status_code == 200
        stop.join(PROMPTLY_S)
        assert stop.result is not None and stop.result[:2] == (200, {"changed": True})
        assert _heartbeat(ca, auth, 3, known)["unchanged"][0]["desired"] == "stop"
        assert a.state.wakeups.waiting == 0


def test_wait_is_bounded_and_refuses_bad_credentials_without_500(settings: Settings) -> None:
    app = create_app(settings.model_copy(update={"agent_wait_max": 1}))
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        auth = _register(c, "lp-2")
        first = _Wait(url, auth, [], timeout_s=5.0)
        first.start()
        _waiting(app)
        r = c.post("/v1/agent/wait", headers=auth, json={"known": []})
        assert r.status_code == 503 and r.headers["Retry-After"]
        assert r.headers["content-type"].startswith("application/problem+json")
        for headers in ({}, {"Authorization": "Bearer nonsense"},
                        {"Authorization": "Bearer tyn_" + "0" * 32 + ".1.x"}):
            r = c.post("/v1/agent/wait", headers=headers, json={"known": []})
            assert r.status_code in (401, 503), r.text  # the cap is checked first for a well-formed one
        r = c.post("/v1/agent/wait", headers=auth, json={"known": "x"})
        assert r.status_code == 422
    first.join(PROMPTLY_S)
    assert first.result is not None and first.result[:2] == (200, {"changed": False})


def test_a_wait_that_asks_for_the_answer_carries_the_change_and_ignores_wake_ups_without_one(settings):
    """WaitRequest.answer: the change itself comes with the wake-up (no heartbeat needed to learn it),
    read again at the wake-up; a wake-up that changed nothing for this node (the listener
    reconnecting wakes every wait) does not end the wait."""
    app = create_app(settings)
    with serve(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        auth = _register(c, "lp-3")
        waiter = _Wait(url, auth, [], timeout_s=60.0, answer=True)
        waiter.start()
        _waiting(app)
        app.state.wakeups.wake_local(list(app.state.wakeups._waiters))  # nothing changed for it
        time.sleep(0.5)
        assert waiter.result is None and app.state.wakeups.waiting == 1
        job = c.post("/v1/jobs", json=job_body(num_nodes=1, gpus_per_node=1), headers=ADMIN).json()
        assert app.state.loops.schedule_once() == 1
        waiter.join(PROMPTLY_S)
        assert waiter.result is not None and waiter.result[0] == 200
        body = waiter.result[1]
        [spec] = body["assignments"]
        assert body["changed"] is True and body["unchanged"] == [] and spec["attempt_id"]
        assert set(spec["storage"]) == {"prefix"}  # credentials come at registration only
        known = [{"attempt_id": spec["attempt_id"], "version": spec["version"]}]
        # The heartbeat agrees: the spec the wait carried is the one held.
        assert _heartbeat(c, auth, 1, known)["unchanged"] == [{**known[0], "desired": "run", "handover_ok": False}]

        stop = _Wait(url, auth, known, timeout_s=60.0, answer=True)
        stop.start()
        _waiting(app)
        assert c.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN).status_code == 200
        stop.join(PROMPTLY_S)
        assert stop.result is not None and stop.result[1] == {
            "changed": True, "assignments": [], "unchanged": [{**known[0], "desired": "stop", "handover_ok": False}]}


def test_a_stopping_server_answers_its_long_polls_instead_of_cancelling_them(settings: Settings) -> None:
    """`trainyard server`'s shutdown (DrainingServer, with the production grace period): a wait in
    flight is answered "nothing changed" (200), as a wake-up without a change would be. uvicorn
    alone waits out its grace period, then cancels the request: the agent got no answer at all and
    the replica logged an error for each held long poll."""
    import uvicorn

    from control_plane.http_deadlines import DrainingServer, uvicorn_options

    app = create_app(settings)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with running(DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", **uvicorn_options(settings))), must_stop=True) as server:
        with httpx.Client(base_url=base, timeout=30) as c:
            auth = _register(c, "draining-1")
        wait = _Wait(base, auth, [], timeout_s=60)
        wait.start()
        _waiting(app)
        server.should_exit = True  # shutdown begins; the wait is answered (or, undrained, cancelled after 3 s)
        wait.join(60)
    assert wait.result is not None, "the long poll got no answer"
    assert wait.result[:2] == (200, {"changed": False})
    assert app.state.wakeups.waiting == 0
