"""The liveness lane (control_plane/lanes.py): which requests are liveness, and the bookkeeping gate's
promises, checked over arbitrary interleavings; the lost-node grace (services/cluster/lost_policy.py)."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from control_plane.lanes import Admission, GateBook, Lane, Lanes, classify
from control_plane.services.cluster.lost_policy import lost_grace_s

ATTEMPT = "/v1/agent/attempts/0b1d6a52-7a43-4f57-9a60-3f2b0fd7a0c1"


@pytest.mark.parametrize(("method", "path", "lane"), [
    ("POST", "/v1/agent/heartbeat", Lane.LIVENESS),
    ("POST", "/v1/agent/register", Lane.LIVENESS),
    ("POST", f"{ATTEMPT}/status", Lane.LIVENESS),
    ("GET", "/healthz", Lane.LIVENESS),
    ("GET", "/readyz", Lane.LIVENESS),
    ("POST", f"{ATTEMPT}/shards", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/events", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/logs", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/storage", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/storage/batch", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/progress", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/upload-slots/release", Lane.BOOKKEEPING),
    ("POST", f"{ATTEMPT}/upload-slots/batch", Lane.OTHER),  # gates its transactions itself
    # Long polls hold no thread while they wait: never gated.
    ("POST", "/v1/agent/wait", Lane.OTHER),
    ("POST", f"{ATTEMPT}/upload-slots", Lane.OTHER),
    # Not agents' reports.
    ("GET", f"{ATTEMPT}/code", Lane.OTHER),
    ("GET", "/v1/agent/heartbeat", Lane.OTHER),
    ("POST", "/v1/jobs", Lane.OTHER),
    ("GET", "/metrics", Lane.OTHER),
    ("POST", "/v1/agent/attempts/x", Lane.OTHER),
])
def test_classify(method: str, path: str, lane: Lane) -> None:
    assert classify(method, path) is lane


# An operation on the gate: a liveness request arrives or ends, a bookkeeping request arrives or
# ends, a waiter gives up. Which request an "end" picks is drawn among those that can end.
OPS = st.lists(st.tuples(st.sampled_from(["l+", "l-", "b+", "b-", "give_up"]), st.integers(0, 1000)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(bound=st.integers(1, 4), queue_max=st.integers(0, 6), ops=OPS)
def test_the_gate_keeps_its_promises(bound: int, queue_max: int, ops: list[tuple[str, int]]) -> None:
    book = GateBook(bound=bound, queue_max=queue_max)
    tickets = itertools.count()
    admitted: list[int] = []  # in admission order
    arrived: list[int] = []  # queued tickets in arrival order
    running: list[int] = []
    live = 0
    for op, pick in ops:
        woken: list[int] = []
        if op == "l+":
            book.liveness_arrived()
            live += 1
        elif op == "l-" and live:
            live -= 1
            woken = book.liveness_done()
        elif op == "b+":
            ticket = next(tickets)
            before = book.in_flight
            answer = book.bookkeeping_arrived(ticket)
            if answer is Admission.ADMITTED:
                # Admitted at once only with room under the bound (one beside liveness), nobody ahead.
                assert before < (bound if live == 0 else 1) and not [t for t in arrived if t not in admitted]
                admitted.append(ticket)
                running.append(ticket)
            elif answer is Admission.QUEUED:
                arrived.append(ticket)
            else:
                assert len(book.waiting) == queue_max
        elif op == "b-" and running:
            running.pop(pick % len(running))
            woken = book.bookkeeping_done()
        elif op == "give_up" and book.waiting:
            ticket = book.waiting[pick % len(book.waiting)]
            assert book.abandon(ticket)
            arrived.remove(ticket)
        if woken and live:
            assert book.in_flight == 1 and len(woken) == 1, "more than one beside liveness in flight"
        admitted += woken
        running += woken
        for t in woken:
            arrived.remove(t)
        assert book.in_flight == len(running) <= bound
        assert len(book.waiting) <= queue_max
        assert list(book.waiting) == arrived  # FIFO: the queue is the arrival order
        # Nobody waits without reason: a waiter is held by a full gate (one is full beside liveness),
        # so bookkeeping always moves: liveness alone never starves it.
        assert not book.waiting or book.in_flight >= (bound if live == 0 else 1)
    # Every admitted request is released: once everything ends, the gate is empty.
    while live:
        live -= 1
        running += book.liveness_done()
    while running:
        running.pop()
        running += book.bookkeeping_done()
    assert book.in_flight == 0 and not book.waiting


def test_the_gate_refuses_bad_bounds() -> None:
    with pytest.raises(ValueError):
        GateBook(bound=0, queue_max=1)


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_beside_a_heartbeat_one_report_runs_and_the_rest_wait_in_order() -> None:
    async def scenario() -> list[int]:
        lanes = Lanes(bookkeeping_concurrency=3, queue_max=10, wait_s=5)
        order: list[int] = []
        release = asyncio.Event()
        ticket = lanes.liveness_arrived()

        async def report(i: int) -> None:
            assert await lanes.admit()
            order.append(i)
            await release.wait()
            lanes.done()

        tasks = [asyncio.create_task(report(i)) for i in range(5)]
        await asyncio.sleep(0.05)
        # One runs beside the heartbeat (bookkeeping never starves); the others wait behind it.
        assert order == [0] and lanes.figures().bookkeeping_queued == 4
        assert lanes.oldest_liveness_s() > 0
        lanes.liveness_done(ticket)
        await asyncio.sleep(0.05)
        assert order == [0, 1, 2]  # the heartbeat answered: up to the bound (3)
        release.set()
        await asyncio.gather(*tasks)
        figures = lanes.figures()
        assert figures.bookkeeping_in_flight == 0 and figures.bookkeeping_waits == 4
        assert lanes.oldest_liveness_s() == 0.0
        return order

    assert _run(scenario()) == [0, 1, 2, 3, 4]


def test_a_full_queue_and_a_long_wait_are_refused_and_a_cancelled_waiter_gives_its_place_back() -> None:
    async def scenario() -> None:
        lanes = Lanes(bookkeeping_concurrency=1, queue_max=1, wait_s=0.1)
        assert await lanes.admit()  # in flight
        waiter = asyncio.create_task(lanes.admit())
        await asyncio.sleep(0)
        assert not await lanes.admit()  # the queue (1) is full
        assert not await waiter  # waited past wait_s
        assert lanes.figures().bookkeeping_refused == 2
        cancelled = asyncio.create_task(lanes.admit())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        lanes.done()
        assert lanes.book.in_flight == 0 and not lanes.book.waiting
        assert await lanes.admit()
        lanes.done()

    _run(scenario())


@given(local=st.floats(0, 1e4), lag=st.none() | st.floats(-10, 1e4), cap=st.floats(0, 1e3))
def test_the_lost_grace_covers_every_queued_heartbeat_up_to_the_cap(local: float, lag: float | None,
                                                                    cap: float) -> None:
    grace = lost_grace_s(local_oldest_s=local, recent_lag_s=lag, cap_s=cap)
    assert 0.0 <= grace <= cap
    assert grace == min(cap, max(local, lag or 0.0, 0.0))


@given(interval=st.floats(0.5, 10), slack=st.floats(0.5, 30), queued=st.floats(0, 100),
       lag=st.none() | st.floats(0, 100))
def test_a_node_whose_heartbeat_waits_here_is_never_lost(interval: float, slack: float, queued: float,
                                                        lag: float | None) -> None:
    """The node sent its previous heartbeat at most an interval before the queued one, which arrived
    ``queued`` seconds ago; the monitor declares it lost only when its last record is older than the
    timeout plus the grace. Within the cap (a queue shorter than the timeout), it never is."""
    timeout = interval + slack  # settings insist the lost timeout exceeds the interval
    if queued > timeout:
        return  # past the cap: a replica that broken no longer holds back the sweeper
    previous_age = queued + interval  # how old the node's last record is now
    grace = lost_grace_s(local_oldest_s=queued, recent_lag_s=lag, cap_s=timeout)
    assert not previous_age > timeout + grace


def test_the_slot_long_polls_transactions_go_through_the_gate() -> None:
    from control_plane.wakeups import Busy

    async def scenario() -> None:
        lanes = Lanes(bookkeeping_concurrency=2, queue_max=1, wait_s=5)
        ran: list[str] = []
        ticket = lanes.liveness_arrived()
        assert await lanes.admit()  # a report runs beside the heartbeat: the one it allows
        gated = asyncio.create_task(lanes.run_gated(lambda: ran.append("slot") or "answer"))
        await asyncio.sleep(0.05)
        assert ran == [] and lanes.figures().bookkeeping_queued == 1  # behind the heartbeat
        with pytest.raises(Busy):  # the queue (1) is full: a 503 with Retry-After
            await lanes.run_gated(lambda: "refused")
        lanes.liveness_done(ticket)
        assert await gated == "answer" and ran == ["slot"]
        lanes.done()
        assert lanes.book.in_flight == 0  # its place is given back once its thread returns

    _run(scenario())
