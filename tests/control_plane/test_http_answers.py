"""No request ends without an answer (issue 28), against a real uvicorn server run with the options
``trainyard server`` gives it: a body that stops arriving is answered 408, and a request sent on a
connection left idle past uvicorn's default keep-alive (5 s) is answered, not dropped."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import requests
import uvicorn
from starlette.types import Message, Receive, Scope, Send

from control_plane.app import create_app
from control_plane.http_deadlines import BodyIdleTimeout, uvicorn_options
from control_plane.settings import Settings
from tests.control_plane.helpers import running
from tests.factories import ADMIN_TOKEN
from trainyard.dev.certs import ServerTls, ensure_server_tls
from trainyard.embedded import free_port

UVICORN_DEFAULT_KEEP_ALIVE_S = 5.0


@contextmanager
def served(settings: Settings, tls: ServerTls | None = None) -> Iterator[int]:
    """The app in uvicorn (a thread of this process) with trainyard server's options; yields its port."""
    port = free_port()
    files = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)} if tls else {}
    with running(uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="on", **uvicorn_options(settings), **files)), must_stop=True):
        yield port


def _read_answer(sock: socket.socket, within_s: float) -> bytes:
    sock.settimeout(within_s)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        pass
    return answer


@pytest.mark.parametrize("framing", ["declared", "chunked"])
def test_a_body_that_stops_arriving_is_answered_408(settings, framing):
    settings = settings.model_copy(update={"request_body_idle_s": 0.5})
    head = (f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n"
            "Content-Type: application/json\r\n")
    if framing == "declared":  # declares 1000 bytes, sends 10
        request = head + "Content-Length: 1000\r\n\r\n" + '{"name": "'
    else:  # one chunk, then nothing
        request = head + "Transfer-Encoding: chunked\r\n\r\na\r\n" + '{"name": "' + "\r\n"
    with served(settings) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(request.encode())
        answer = _read_answer(sock, within_s=10)
        waited = time.monotonic() - started
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer
    assert b"content-type: application/problem+json" in rest.lower()
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["status"] == 408
    assert 0.5 <= waited < 5, waited  # the idle time, then at once (the server closed: recv saw its end)


def test_a_kept_alive_connection_idle_past_uvicorns_default_still_answers(settings):
    """With uvicorn's default (5 s) the second request gets no answer: http.client, like requests and
    schemathesis, sends on a kept connection without checking that the server still holds it."""
    assert settings.http_keep_alive_s > UVICORN_DEFAULT_KEEP_ALIVE_S + 1
    body = json.dumps({"nodes": 8, "node_mtbf_h": 1000, "blocking_s": 5, "work_h": 10, "runs": 1})
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    with served(settings) as port:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            for n in range(2):
                if n:
                    time.sleep(UVICORN_DEFAULT_KEEP_ALIVE_S + 0.5)  # the idleness under test, not a wait for a state
                connection.request("POST", "/v1/simulations", body=body, headers=headers)
                response = connection.getresponse()
                assert response.status == 200, response.read()
                response.read()
        finally:
            connection.close()


def test_after_the_body_the_app_may_wait_on_receive_as_long_as_it_likes():
    """A long poll or a followed log listens on receive() for a disconnect: only the body is timed."""
    async def scenario() -> list[Message]:
        pending: list[Message] = [{"type": "http.request", "body": b"{}", "more_body": False}]
        gone = asyncio.Event()

        async def receive() -> Message:
            if pending:
                return pending.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        sent: list[Message] = []

        async def send(message: Message) -> None:
            sent.append(message)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            assert (await receive())["body"] == b"{}"
            listening = asyncio.create_task(receive())
            await asyncio.sleep(0.3)  # three idle times: the idleness under test
            assert not listening.done()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})
            gone.set()
            assert (await listening)["type"] == "http.disconnect"

        await BodyIdleTimeout(app, idle_s=0.1)({"type": "http", "path": "/v1/agent/wait"}, receive, send)
        return sent

    sent = asyncio.run(scenario())
    assert [m.get("status") for m in sent if m["type"] == "http.response.start"] == [200]


def test_a_body_over_the_limit_is_answered_413_over_tls_not_cut_off(settings, tmp_path):
    """The issue's "EOF occurred in violation of protocol": the 413 went out while the client still
    sent its body, the connection closed with the body unread, and the reset discarded the 413. A
    client that writes its whole body before reading (requests, as schemathesis) lost 15 of 16 such
    answers over TLS before BodyLimit read the refused body to its end."""
    tls = ensure_server_tls(tmp_path / "tls", ["127.0.0.1"])
    settings = settings.model_copy(update={"max_request_bytes": 64 * 1024})
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"}
    with served(settings, tls) as port:
        for framing in ("declared", "chunked") * 3:
            body = b"x" * 2_000_000
            data = iter([body[i:i + 65536] for i in range(0, len(body), 65536)]) if framing == "chunked" else body
            r = requests.post(f"https://127.0.0.1:{port}/v1/jobs", data=data, headers=headers,
                              verify=str(tls.ca_file), timeout=30)
            assert r.status_code == 413 and r.headers["content-type"] == "application/problem+json", framing
