"""The agent's coalescer (node_agent/link/batcher.py): the local API's request threads submit
items; one request per batch goes out; every thread gets exactly its own item's answer, whatever
the order and timing of arrivals, the keys, and the batches in flight."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_agent.link.batcher import Coalescer


class Recorder:
    """A send function that answers each item with its key and itself, and records each batch."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.batches: list[tuple[str, list[int]]] = []
        self.delay_s = delay_s
        self._lock = threading.Lock()

    def __call__(self, key: str, items: Sequence[int]) -> list[str]:
        with self._lock:
            self.batches.append((key, list(items)))
        time.sleep(self.delay_s)
        return [f"{key}:{item}" for item in items]


def _run(coalescer: Coalescer[str, int, str], arrivals: list[tuple[float, str]], full_at: int = 0) -> dict[int, str]:
    answers: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(arrivals))

    def one(item: int, delay_s: float, key: str) -> None:
        start.wait()
        time.sleep(delay_s)
        try:
            answers[item] = coalescer.submit(key, item, full_at=full_at)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i, d, k)) for i, (d, k) in enumerate(arrivals)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    return answers


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.tuples(st.floats(0, 0.03), st.sampled_from("abc")), min_size=1, max_size=24),
       window_s=st.sampled_from([0.0, 0.005, 0.02]), send_s=st.sampled_from([0.0, 0.01]),
       full_at=st.integers(0, 6))
def test_every_item_gets_exactly_its_own_answer_in_any_arrival_order(arrivals, window_s, send_s, full_at) -> None:
    send = Recorder(send_s)
    coalescer: Coalescer[str, int, str] = Coalescer(send, window_s=window_s)
    answers = _run(coalescer, arrivals, full_at)
    assert answers == {i: f"{key}:{i}" for i, (_, key) in enumerate(arrivals)}
    sent = sorted(item for _, items in send.batches for item in items)
    assert sent == list(range(len(arrivals)))  # each item in exactly one batch, under its own key
    assert all(arrivals[item][1] == key for key, items in send.batches for item in items)
    if full_at:
        assert all(len(items) <= full_at for _, items in send.batches)
    assert coalescer.batches == len(send.batches) and coalescer.items == len(arrivals)


def test_the_requests_of_a_node_that_come_together_go_as_one() -> None:
    send = Recorder()
    coalescer: Coalescer[str, int, str] = Coalescer(send, window_s=0.2)
    _run(coalescer, [(0.0, "a")] * 8)
    assert [len(items) for _, items in send.batches] == [8]


def test_a_full_batch_goes_at_once_without_waiting_for_the_window() -> None:
    send = Recorder()
    coalescer: Coalescer[str, int, str] = Coalescer(send, window_s=30.0)
    started = time.monotonic()
    _run(coalescer, [(0.0, "a")] * 8, full_at=8)
    assert time.monotonic() - started < 10.0
    assert [len(items) for _, items in send.batches] == [8]
    bounded: Coalescer[str, int, str] = Coalescer(Recorder(), window_s=30.0, max_items=4)
    started = time.monotonic()
    _run(bounded, [(0.0, "a")] * 8)  # two full batches of the most one may hold
    assert time.monotonic() - started < 10.0 and bounded.batches == 2


def test_a_batch_in_flight_does_not_hold_up_the_next() -> None:
    """A slot long poll may be held for seconds: an item that comes meanwhile opens the next batch
    and is answered without waiting for it."""
    release = threading.Event()

    def send(key: str, items: Sequence[int]) -> list[str]:
        if 0 in items:
            release.wait(30)
        return [str(i) for i in items]

    coalescer: Coalescer[str, int, str] = Coalescer(send, window_s=0.0)
    first: list[str] = []
    held = threading.Thread(target=lambda: first.append(coalescer.submit("a", 0)))
    held.start()
    deadline = time.monotonic() + 10
    while coalescer.batches < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert coalescer.submit("a", 1) == "1"
    assert first == []
    release.set()
    held.join(10)
    assert first == ["0"]


def test_a_send_that_fails_fails_each_item_of_its_batch_and_no_other() -> None:
    def send(key: str, items: Sequence[int]) -> list[str]:
        if key == "bad":
            raise RuntimeError("boom")
        return [str(i) for i in items[:-1]] if key == "short" else [str(i) for i in items]

    coalescer: Coalescer[str, int, str] = Coalescer(send, window_s=0.0)
    with pytest.raises(RuntimeError, match="boom"):
        coalescer.submit("bad", 1)
    with pytest.raises(RuntimeError, match="got 0 answers"):
        coalescer.submit("short", 1)
    assert coalescer.submit("good", 2) == "2"
    with pytest.raises(ValueError):
        Coalescer(send, window_s=-1)
