"""Bounds on the agent's servers, shared by the workers' local API (local/api.py) and the peer port of
the in-memory checkpoint tier (memtier/tier.py): a thread per connection only while a gate lets it in
(``Gate``; a connection beyond it gets ``refuse``: a problem+json answer, then closed), and a
deadline for the whole request (``DeadlineReader``), so that a client that sends nothing, or one byte
at a time, holds its thread no longer than the deadline.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import threading
import time
from http import HTTPStatus
from typing import Any


def problem_bytes(status: HTTPStatus, detail: str, *, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer carrying an RFC 9457 problem, ready to write to a raw socket."""
    body = json.dumps({"type": "about:blank", "title": status.phrase, "status": int(status),
                       "detail": detail}, separators=(",", ":")).encode()
    head = [f"HTTP/1.1 {int(status)} {status.phrase}", "Content-Type: application/problem+json",
            *([f"Retry-After: {retry_after_s}"] if retry_after_s is not None else []),
            "Connection: close", f"Content-Length: {len(body)}"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


BUSY = problem_bytes(HTTPStatus.SERVICE_UNAVAILABLE, "too many connections", retry_after_s=1)


def refuse(conn: socket.socket, answer: bytes = BUSY) -> None:
    """Answer ``conn`` without a thread and close it (never blocks: a fresh socket's send buffer
    takes a short answer whole)."""
    with contextlib.suppress(OSError):
        conn.setblocking(False)
        conn.send(answer)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(65536)  # what already came, so that closing does not reset the answer
    conn.close()


class Gate:
    """A count (connections, or bytes) with a limit that may grow and shrink (unlike a semaphore)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def acquire(self, amount: int = 1) -> bool:
        with self._lock:
            if self._held + amount > self.limit:
                return False
            self._held += amount
            return True

    def release(self, amount: int = 1) -> None:
        with self._lock:
            self._held -= amount

    def resize(self, delta: int) -> None:
        with self._lock:
            self.limit += delta


class KeyedGates:
    """One Gate per key (a client's address), each of ``limit``; a key's gate goes when it is empty."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> bool:
        with self._lock:
            held = self._held.get(key, 0)
            if held >= self.limit:
                return False
            self._held[key] = held + 1
            return True

    def release(self, key: str) -> None:
        with self._lock:
            held = self._held.get(key, 0) - 1
            if held > 0:
                self._held[key] = held
            else:
                self._held.pop(key, None)


class DeadlineReader(io.RawIOBase):
    """The connection's bytes, up to a deadline for the whole request (a slow sender cannot hold
    a handler thread longer). ``deadline`` may be moved later once the request says how long its
    body is (a shard may take time in proportion to its size)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self.deadline = deadline
        self.expired = False
        """The deadline passed before the request was read (the server may say so: 408)."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError("the request did not arrive in time")
            self._sock.settimeout(remaining)
            return self._sock.recv_into(buffer)
        except TimeoutError:
            self.expired = True
            raise


class SocketWriter(io.BufferedIOBase):
    """Writes straight to the socket; with a ``deadline``, the whole answer must be taken by then (a
    client that reads slowly cannot hold the thread either)."""

    def __init__(self, sock: socket.socket, deadline: float | None = None) -> None:
        self._sock = sock
        self.deadline = deadline

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        if self.deadline is None:
            self._sock.sendall(data)
            return len(data)
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _PIECE):
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the answer was not taken in time")
            self._sock.settimeout(remaining)
            self._sock.sendall(view[start:start + _PIECE])
        return len(view)


_PIECE = 1 << 20
