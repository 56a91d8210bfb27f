"""A request body limit for the whole API (settings.max_request_bytes): 413 problem+json.

A pure ASGI middleware: a declared Content-Length over the limit is refused before anything is
read (the server then delivers no more than it declared), and a body sent without one (chunked) is
counted as the app reads it and refused once it passes the limit: this middleware buffers nothing,
and no request can make the app read more than the limit. A refused body is read to its end (and
dropped) before the 413, up to DRAIN_MAX_BYTES: see ``drain``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from control_plane.errors import PROBLEM_JSON


class BodyLimit:
    """``larger``: path prefix -> its own limit (code archives are larger than any JSON body)."""

    def __init__(self, app: ASGIApp, max_bytes: int, larger: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.larger = dict(larger or {})

    def limit(self, path: str) -> int:
        return next((n for prefix, n in self.larger.items() if path.startswith(prefix)), self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit(scope.get("path", ""))
        declared = _content_length(scope)
        if declared is not None and (declared < 0 or declared > limit):
            if 0 <= declared <= DRAIN_MAX_BYTES:
                await drain(receive)
            await self._refuse(scope, send, declared, limit)
            return
        if declared is not None:
            await self.app(scope, receive, send)  # the server delivers no more than it declares
            return
        # No Content-Length (chunked): counted as the app reads it, never buffered here (a code
        # archive streams to storage: services/runs/code_upload.py). Past the limit the app is told the
        # client went away, and the caller gets the 413 instead of whatever the app then answers.
        seen = 0
        over = False
        unread = False
        started = False

        async def counted() -> Message:
            nonlocal seen, over, unread
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    unread = bool(message.get("more_body", False))
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if over:
                return  # the 413 below answers instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over and not started:
            if unread:
                await drain(receive)
            await self._refuse(scope, send, None, limit)

    async def _refuse(self, scope: Scope, send: Send, declared: int | None, limit: int) -> None:
        size = f"{declared} bytes" if declared is not None and declared >= 0 else "more"
        body: dict[str, Any] = {
            "type": "https://trainyard.dev/problems/too-large",
            "title": "The request body is too large",
            "status": 413,
            "detail": f"the body is {size}; at most {limit} bytes are accepted (max_request_bytes, "
                      "max_code_bytes for code)",
            "instance": scope.get("path", ""),
        }
        payload = json.dumps(body).encode()
        headers = [(b"content-type", PROBLEM_JSON.encode()), (b"content-length", str(len(payload)).encode()),
                   (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


# --- Reading a refused body to its end (issue 28) ------------------------------------------------
DRAIN_MAX_BYTES = 64 * 1024 * 1024
"""A refused body up to this size is read (and dropped) before the 413 goes out."""
DRAIN_MAX_S = 10.0


async def drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, within DRAIN_MAX_BYTES and DRAIN_MAX_S.

    Why: a 413 sent while the client still sends its body, then the connection closed with that body
    unread, resets the connection, and the reset discards the 413 before the client reads it: a
    client that writes its whole body before it reads (requests, urllib3, schemathesis) saw no answer
    ("Connection reset by peer", over TLS "EOF occurred in violation of protocol"). A body larger
    still is cut short: reading it all would cost more than the answer is worth."""
    read = 0
    try:
        async with asyncio.timeout(DRAIN_MAX_S):
            while read <= DRAIN_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                read += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return
    except TimeoutError:
        return


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return None
