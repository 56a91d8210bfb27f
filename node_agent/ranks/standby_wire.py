"""The standby protocol's framing and the rules both ends share (standard library only).

A rank shim (node_agent/ranks/shim.py) hands one rank to a warm standby process
(node_agent/ranks/standby.py) over a unix stream socket. Every message is a 4-byte big-endian length and
a JSON object; the first one, from the shim, carries the worker's stdout and stderr descriptors
(SCM_RIGHTS)::

    shim -> standby   {"python", "prefix", "kind", "entrypoint", "args", "env", "cwd"} + [stdout, stderr]
    standby -> shim   {"pid": N}                  the worker runs, as process N
                      {"declined": "why"}         nothing happened; the shim starts the rank cold
    standby -> shim   {"returncode": N}           the worker ended (negative: killed by a signal)

This module must stay import-light, like the shim that imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
from typing import Any, Final

SOCKET_SUFFIX: Final = ".sock"
"""A standby's socket is ``<standby dir>/<name>.sock``; it appears only once the standby is warm."""
CLAIMED_SUFFIX: Final = ".claimed"
"""What a standby renames its socket to when a rank claims it (node_agent/ranks/standby_pool.py)."""
MAX_MESSAGE: Final = 1 << 20
MAX_FDS: Final = 2

STARTUP_PREFIXES: Final = (
    "PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "MALLOC_",
)
"""Variables the interpreter, its loader or torch read while starting or importing (libgomp reads
OMP_* when it is loaded, Python its PYTHON* at start): a standby that imported with other values
than a rank asks for would not be the process a cold start makes, so it declines that rank."""
APPLIED_AT_HANDOVER: Final = frozenset({"PYTHONPATH", "OMP_NUM_THREADS"})
"""Startup variables a standby applies itself when it becomes the worker: sys.path is rebuilt, and
torch's intra-op threads are set to what a cold start's would be (the rank's OMP_NUM_THREADS, or
without it OpenMP's default, one per CPU the process may run on). A standby imports with
OMP_NUM_THREADS=1 (more starts threads at import, and a process with threads cannot fork
safely), while torchrun sets it for ranks only when a node runs more than one."""


def claimed_path(socket_path: Any) -> Any:
    """``<name>.claimed`` for the socket ``<name>.sock`` (a str or a Path, returned alike)."""
    text = str(socket_path)
    claimed = text[: -len(SOCKET_SUFFIX)] + CLAIMED_SUFFIX if text.endswith(SOCKET_SUFFIX) else text + CLAIMED_SUFFIX
    return type(socket_path)(claimed)


def startup_env(env: dict[str, str]) -> dict[str, str]:
    """The part of ``env`` a standby must share with the rank it runs (see STARTUP_PREFIXES)."""
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES) and k not in APPLIED_AT_HANDOVER}


def send(sock: socket.socket, payload: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(payload).encode()
    frame = struct.pack(">I", len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        if sent < len(frame):
            sock.sendall(frame[sent:])
    else:
        sock.sendall(frame)


def _read_exact(sock: socket.socket, n: int, first: bytes = b"") -> bytes:
    buf = bytearray(first)
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def receive(sock: socket.socket, *, with_fds: bool = False) -> tuple[dict[str, Any], list[int]]:
    """One message (and the descriptors sent with it); raises ConnectionError or ValueError."""
    fds: list[int] = []
    if with_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, 4, MAX_FDS)
        if not head:
            raise ConnectionError("the peer closed the connection")
    else:
        head = sock.recv(4)
        if not head:
            raise ConnectionError("the peer closed the connection")
    try:
        (length,) = struct.unpack(">I", _read_exact(sock, 4, head))
        if length > MAX_MESSAGE:
            raise ValueError(f"message of {length} bytes is over the limit")
        payload = json.loads(_read_exact(sock, length))
        if not isinstance(payload, dict):
            raise ValueError("a message must be a JSON object")
    except BaseException:
        for fd in fds:
            _close(fd)
        raise
    return payload, fds


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
