"""Every request gets an answer (issue 28): the HTTP server's own timings.

- A body that stops arriving: uvicorn waits for the rest of a request body for ever (it has no
  read timeout), so a client that declares more bytes than it sends, or stalls mid-body, holds a
  connection and a task and never hears back. ``BodyIdleTimeout`` answers it 408 problem+json once
  no byte of the body has come for ``request_body_idle_s``.
- An idle kept-alive connection: uvicorn closes one after ``timeout_keep_alive`` (5 s by default).
  A client that sends its next request on it as the server closes it gets no answer ("Remote end
  closed connection without response"; over TLS "EOF occurred in violation of protocol"), and a
  POST is not retried. It happens to any client that keeps connections as long as the server
  does or longer (httpx, the agents' client, keeps them 5 s; requests and schemathesis for ever):
  the server keeps them longer (``http_keep_alive_s``), as a server behind a load balancer must.
- A stopping server: the long polls it holds answer at once (``DrainingServer``), so a replica
  stops in well under a second instead of waiting its grace period out.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.errors import PROBLEM_JSON
from control_plane.wakeups import drain_all

if TYPE_CHECKING:
    from control_plane.settings import Settings


SHUTDOWN_GRACE_S = 3
"""How long a stopping control plane lets requests in flight finish (uvicorn's graceful shutdown)."""


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What ``trainyard server`` gives uvicorn besides the address and TLS."""
    # A stopping replica does not wait out its long polls (up to TRAINYARD_AGENT_WAIT_TIMEOUT_S, their
    # agents already gone or about to ask another replica): requests still in flight after
    # SHUTDOWN_GRACE_S are cancelled. Ctrl-C of `dev up` took 14.6 s, 10 of them waiting here.
    return {"timeout_keep_alive": settings.http_keep_alive_s, "timeout_graceful_shutdown": SHUTDOWN_GRACE_S}


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first answers the long polls it holds (``drain_all``).

    uvicorn stops listening, then waits up to its grace period for the requests in flight, and only
    then runs the app's shutdown. A long poll (an agent's wait, a worker's upload-slot ask) ends only
    when woken: without the drain every stop of a replica that held one took the whole grace period
    (3 s of the 4.6 s a `dev up` stop took) and logged a cancelled request as an error."""

    async def shutdown(self, sockets: Any = None) -> None:
        drain_all()
        await super().shutdown(sockets)


class BodyIdleTimeout:
    """Answers 408 when a request body stops arriving for ``idle_s``; passes everything else."""

    def __init__(self, app: ASGIApp, idle_s: float) -> None:
        self.app = app
        self.idle_s = idle_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_done = False
        timed_out = False
        started = False

        async def timed_receive() -> Message:
            nonlocal body_done, timed_out
            if body_done or timed_out:
                # After the body, receive() only tells of a disconnect (a long poll or a stream
                # waits on it for as long as it likes).
                return await receive() if not timed_out else {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), self.idle_s)
            except TimeoutError:
                timed_out = True
                if not started:
                    await _answer_408(scope, send, self.idle_s)
                # The app then reads a disconnect: it stops, and what it sends is dropped.
                return {"type": "http.disconnect"}
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if timed_out:
                return  # answered 408 already
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not timed_out:
                raise
            # The app failed on the disconnect it was given (Starlette's ClientDisconnect): the 408 is
            # the answer.


async def _answer_408(scope: Scope, send: Send, idle_s: float) -> None:
    payload = json.dumps({
        "type": "https://trainyard.dev/problems/request-timeout",
        "title": "The request body stopped arriving",
        "status": 408,
        "detail": f"no byte of the request body came for {idle_s:g}s (request_body_idle_s); send it again",
        "instance": scope.get("path", ""),
    }).encode()
    headers = [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(payload)).encode()),
               (b"connection", b"close")]
    await send({"type": "http.response.start", "status": 408, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
