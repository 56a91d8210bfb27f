"""HTTP clients for the node agent's local API: over the attempt's unix socket when the agent gave
one (TRAINYARD_AGENT_SOCKET, node_agent/local/api.py), else to the URL itself."""

from __future__ import annotations

import functools
import ssl

import httpx

from worker_runtime.context import WorkerContext


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context per process. httpx builds a fresh one for every client, loading the whole
    trust store (about 20 ms of CPU), even for a unix socket that never carries TLS; a worker makes
    a client per checkpoint request (slots, grants, renewals, releases), which cost a rank a quarter
    of its CPU at a checkpoint every few seconds."""
    return httpx.create_ssl_context()


def socket_client(agent_socket: str | None, timeout: float) -> httpx.Client:
    # trust_env=False: a proxy from the job's environment must never sit between a worker and its agent.
    if agent_socket:
        return httpx.Client(timeout=timeout, trust_env=False, verify=_tls(),
                            transport=httpx.HTTPTransport(uds=agent_socket, verify=_tls()))
    return httpx.Client(timeout=timeout, trust_env=False, verify=_tls())


def agent_client(ctx: WorkerContext, timeout: float) -> httpx.Client:
    return socket_client(ctx.agent_socket, timeout)
