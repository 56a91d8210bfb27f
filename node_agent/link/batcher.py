"""Coalescing of the workers' requests into one request per node (issue 27; docs/architecture.md,
"Checkpoint upload slots").

At a checkpoint every rank of a node asks its agent for an upload slot, then for storage grants,
then gives the slot back, all within milliseconds of each other. Relayed one by one they cost the
control plane three requests per rank; gathered here they cost it one per node and kind.

The local API serves each worker's request on a thread of its own (local/api.py). Each thread
``submit``s its item under a key (an attempt and a kind of request) and blocks until its answer is
there. The first item of a key opens a batch and its thread becomes the batch's sender: it waits
for the window (``window_s`` after that first item) or until the batch is full (``full_at`` items,
the attempt's ranks on this node: nobody else will come), closes the batch, sends it with ``send``
and hands each item its own answer. Items that arrive while a batch is being sent open the next
one: a batch in flight (a slot long poll may last seconds) never holds up the next (a release).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

WINDOW_S = 0.05
"""How long a batch gathers items after its first one, at most. The ranks of a save ask within
milliseconds of each other, but on a busy node their requests reach the agent over tens of
milliseconds: 8 ranks' asks, grants and releases went as 10 requests with 20 ms, 4 to 6 with 50 ms
(tests/control_plane/test_upload_batches.py on a loaded 2-core machine). A batch holding a request
of every local rank goes at once, so the window only delays the stragglers."""
MAX_ITEMS = 4096
"""Items one batch holds at most (the wire's bound); more open the next batch."""

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Batch(Generic[T, R]):
    items: list[T] = field(default_factory=list)
    answers: list[Future[R]] = field(default_factory=list)
    full: threading.Event = field(default_factory=threading.Event)


class Coalescer(Generic[K, T, R]):
    """Gathers the items submitted under one key within a window into one ``send(key, items)``,
    which answers each item, in order (a list as long as ``items``). Thread-safe.

    Should ``send`` raise, every item of its batch raises that error (the caller's relay turns the
    errors it knows into answers inside ``send``: this is the last resort)."""

    def __init__(self, send: Callable[[K, Sequence[T]], Sequence[R]], *, window_s: float = WINDOW_S,
                 max_items: int = MAX_ITEMS) -> None:
        if window_s < 0 or max_items < 1:
            raise ValueError("need window_s >= 0 and max_items >= 1")
        self._send = send
        self.window_s = window_s
        self.max_items = max_items
        self._lock = threading.Lock()
        self._open: dict[K, _Batch[T, R]] = {}
        self.batches = 0
        """Batches sent so far (diagnostics and tests)."""
        self.items = 0
        """Items they carried."""

    def submit(self, key: K, item: T, *, full_at: int = 0) -> R:
        """``item``'s answer, once its batch (under ``key``) was sent; ``full_at``: items that fill a
        batch (it goes at once), 0 for the window only."""
        answer: Future[R] = Future()
        with self._lock:
            batch = self._open.get(key)
            sender = batch is None
            if batch is None:
                batch = self._open[key] = _Batch()
            batch.items.append(item)
            batch.answers.append(answer)
            if len(batch.items) >= self.max_items or (full_at > 0 and len(batch.items) >= full_at):
                del self._open[key]  # closed: the next item opens the next batch
                batch.full.set()
        if sender:
            self._gather_and_send(key, batch)
        return answer.result()

    def _gather_and_send(self, key: K, batch: _Batch[T, R]) -> None:
        batch.full.wait(self.window_s)
        with self._lock:
            if self._open.get(key) is batch:
                del self._open[key]
            items, answers = list(batch.items), list(batch.answers)
            self.batches += 1
            self.items += len(items)
        try:
            results = list(self._send(key, items))
            if len(results) != len(items):
                raise RuntimeError(f"a batch of {len(items)} items got {len(results)} answers")
        except BaseException as exc:  # every waiting thread must be answered, whatever happened
            for future in answers:
                future.set_exception(exc)
            return
        for future, result in zip(answers, results, strict=True):
            future.set_result(result)
