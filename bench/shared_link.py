"""A shared link for benches: a TCP proxy that forwards at most a given number of bytes per second,
in all, whatever the number of connections through it (a rack's uplink, a storage gateway).

Each connection's bytes wait for tokens of one shared bucket, taken in turn (a FIFO of waiters),
so the connections share the rate about evenly, as flows on a congested link do.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import deque

CHUNK = 32 * 1024


class SharedRate:
    """A token bucket of ``rate`` bytes/s served first come, first served."""

    def __init__(self, rate: int, burst: int = 2 * CHUNK) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()

    def take(self, n: int) -> None:
        me = object()
        with self._cond:
            self._queue.append(me)
            while True:
                now = time.monotonic()
                self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
                self._last = now
                if self._queue[0] is me and self._tokens >= min(n, self.burst):
                    self._tokens -= n
                    self._queue.popleft()
                    self._cond.notify_all()
                    return
                wait = (min(n, self.burst) - self._tokens) / self.rate if self._queue[0] is me else 0.05
                self._cond.wait(max(0.0005, wait))


class ThrottledProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (host:port); client -> server bytes at most
    ``rate_bytes_per_s`` in all (uploads share it), answers unthrottled."""

    def __init__(self, target: str, *, rate_bytes_per_s: int) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.limit = SharedRate(rate_bytes_per_s)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(256)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="link-accept").start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            # A small send buffer: bytes leave at the link's pace, not into a large kernel buffer.
            upstream.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
            with self._lock:
                self._conns |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, limited: bool) -> None:
        try:
            while chunk := src.recv(CHUNK):
                if limited:
                    self.limit.take(len(chunk))
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._conns.discard(s)
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.close()
