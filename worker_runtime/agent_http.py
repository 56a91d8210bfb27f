"""HTTP clients for the node agent's local API: over the attempt's unix socket when the agent gave
one (TRAINYARD_AGENT_SOCKET, node_agent/local/api.py), else to the URL itself."""

from __future__ import annotations

import httpx

from worker_runtime.context import WorkerContext


def socket_client(agent_socket: str | None, timeout: float) -> httpx.Client:
    # trust_env=False: a proxy from the job's environment must never sit between a worker and its agent.
    if agent_socket:
        return httpx.Client(timeout=timeout, trust_env=False, transport=httpx.HTTPTransport(uds=agent_socket))
    return httpx.Client(timeout=timeout, trust_env=False)


def agent_client(ctx: WorkerContext, timeout: float) -> httpx.Client:
    return socket_client(ctx.agent_socket, timeout)
