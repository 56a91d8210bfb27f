"""Joining a TCPStore that another process hosts, without paying torch's connect backoff.

A TCPStore client that finds nobody listening retries with a growing, jittered backoff (torch 2.13:
the first retry about half a second later), so a client that arrives before the store's host loses
up to that much after the host comes up. On the 2-core development machine, a host up 10 ms after
its client had the client connected after 0.46-0.69 s; a host up 1.0 s after, 2.36 s. A recovery
starts every node of the new attempt at once, and whether node rank 0's torchrun (the static
rendezvous's host) or a fresh global rank 0 (a restartable attempt's fenced store) finishes its
imports first is chance. So a client first waits here, with a plain connect every ``POLL_S``, until
the port accepts, and only then creates its TCPStore, which connects at its first try. The probe
sends nothing: the host sees a connection that closes at once, as after a client's own failed try.

Standard library only (node_agent.ranks.torchrun_entry runs it while torch imports).
"""

from __future__ import annotations

import socket
import time

POLL_S = 0.01
"""How often a waiting client tries the port (a refused connect costs microseconds)."""


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port`` or ``[v6 host]:port`` (torchrun's --rdzv-endpoint) as (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"not a host:port endpoint: {endpoint!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def wait_for_listener(host: str, port: int, timeout_s: float, *, poll_s: float = POLL_S) -> int | None:
    """Wait until ``host:port`` accepts a TCP connection; return how many tries were refused first
    (0: it accepted at once), or None if it did not accept within ``timeout_s`` (the caller's own
    connect then fails as it would have, with its own error)."""
    deadline = time.monotonic() + timeout_s
    refused = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        try:
            socket.create_connection((host, port), timeout=min(left, 1.0)).close()
            return refused
        except OSError:
            refused += 1
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
