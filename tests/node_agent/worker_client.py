"""What the test workers use to reach their agent's local API: http.client over the attempt's unix
socket (standard library only; a worker script imports it from the repository root)."""

from __future__ import annotations

import http.client
import json
import os
import socket
from typing import Any


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("trainyard-agent", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def request(method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
            socket_path: str | None = None, timeout: float = 40.0) -> tuple[int, Any]:
    conn = UnixConnection(socket_path or os.environ["TRAINYARD_AGENT_SOCKET"], timeout)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(data) if data else {}
    except ValueError:
        return resp.status, data.decode(errors="replace")


def post(kind: str, body: dict[str, Any], timeout: float = 40.0) -> tuple[int, Any]:
    """POST to this worker's attempt (its token added): (status, JSON answer)."""
    body = {**body, "fencing_token": os.environ["TRAINYARD_FENCING_TOKEN"]}
    path = f"/v1/local/attempts/{os.environ['TRAINYARD_ATTEMPT_ID']}/{kind}"
    return request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"}, timeout=timeout)
