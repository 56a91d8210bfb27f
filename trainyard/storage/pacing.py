"""Pacing of checkpoint uploads to the byte rate of their upload slot (docs/architecture.md,
"Checkpoint upload slots"): a token bucket the upload draws from before each chunk it sends.

The rate can change while the upload runs (a renewal brings the node's current share of its
budget) and pacing can be lifted at once (``lift``: the next save is due, and training must not
wait for a slow upload any longer than it waits for the upload itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

from trainyard.protocol.storage import Pace

CHUNK = 64 * 1024
"""Bytes sent per draw: small enough that a paced upload sends steadily, not in bursts."""


class Pacer:
    """A token bucket of ``rate`` bytes per second (None: unpaced) holding at most ``burst`` bytes;
    unpaced for good once ``lifted`` is set."""

    def __init__(self, rate: int | None, *, burst: int = 4 * CHUNK, lifted: threading.Event | None = None) -> None:
        if rate is not None and rate < 1:
            raise ValueError(f"rate must be None or at least 1 byte/s, got {rate}")
        self._lock = threading.Lock()
        self._rate = rate
        self._burst = max(1, burst)
        self._tokens = float(self._burst)
        self._last = time.monotonic()
        self._lifted = lifted if lifted is not None else threading.Event()
        self.waited_s = 0.0
        """Time spent held back so far."""

    @property
    def rate(self) -> int | None:
        return None if self._lifted.is_set() else self._rate

    def set_rate(self, rate: int | None) -> None:
        with self._lock:
            self._refill()
            self._rate = rate

    def lift(self) -> None:
        """Stop pacing for good (whatever rate a renewal brings later)."""
        self._lifted.set()

    def _refill(self) -> None:
        now = time.monotonic()
        if self._rate is not None:
            self._tokens = min(float(self._burst), self._tokens + (now - self._last) * self._rate)
        self._last = now

    def take(self, n: int) -> None:
        """Block until ``n`` bytes may be sent (larger draws than the burst are let through once the
        bucket has been refilled for them)."""
        while True:
            with self._lock:
                if self._rate is None or self._lifted.is_set():
                    return
                self._refill()
                need = min(float(n), float(self._burst))
                if self._tokens >= need:
                    self._tokens -= n  # may go negative: a large draw is paid for by the next ones
                    return
                delay = (need - self._tokens) / self._rate
            started = time.monotonic()
            self._lifted.wait(min(delay, 1.0))  # wakes early when lifted; re-reads a changed rate each second
            self.waited_s += time.monotonic() - started


def paced_chunks(data: BinaryIO, length: int, pacer: Pace, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """``length`` bytes of ``data`` in chunks, each released by ``pacer`` (raises EOFError when
    ``data`` ends early: a short upload must fail, not store a prefix)."""
    left = length
    while left > 0:
        block = data.read(min(chunk, left))
        if not block:
            raise EOFError(f"the data ended {left} bytes before its length of {length}")
        pacer.take(len(block))
        left -= len(block)
        yield block
