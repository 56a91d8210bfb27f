"""The rank shim's side of the standby protocol (node_agent/ranks/standby_wire.py): claim a warm standby
for this rank, or say there is none so the shim starts the rank cold. Standard library only.

A claimed standby behaves for the shim like the subprocess.Popen of a cold start: a pid (the
worker's own, which the rank file records), signals sent straight to it, and wait() with the exact
exit code (negative for a signal). If the standby dies before it could report (the attempt's
cgroup was killed), the worker died with it (its death signal is SIGKILL): -9.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import sys
from pathlib import Path

from node_agent.ranks import standby_wire as wire

CONNECT_TIMEOUT_S = 2.0
REPLY_TIMEOUT_S = 30.0
"""A standby answers once it has confined itself and forked: milliseconds, unless the node is
overloaded; past this the shim gives up on it (and it, seeing the shim gone, on the rank)."""


class StandbyWorker:
    def __init__(self, conn: socket.socket, pid: int, standby: str) -> None:
        self._conn = conn
        self.pid = pid
        self.standby = standby
        """The socket path of the standby that runs the rank (for the shim's log)."""
        self.returncode: int | None = None

    @property
    def standby_pid(self) -> int | None:
        """The standby's own pid (the worker's parent), from the socket's peer credentials."""
        try:
            pid, _, _ = struct.unpack("3i", self._conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
        except OSError:
            return None
        return pid

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def wait(self) -> int:
        if self.returncode is None:
            self._conn.settimeout(None)
            try:
                reply, _ = wire.receive(self._conn)
                code = reply.get("returncode")
            except (OSError, ValueError, ConnectionError):
                code = None
            self.returncode = code if isinstance(code, int) else -int(signal.SIGKILL)
            self._conn.close()
        return self.returncode


def _request(kind: str, entrypoint: str, args: list[str], env: dict[str, str], cwd: str) -> dict[str, object]:
    return {"python": sys.executable, "prefix": sys.prefix, "kind": kind, "entrypoint": entrypoint,
            "args": args, "env": env, "cwd": cwd}


def claim(
    directory: Path, kind: str, entrypoint: str, args: list[str], env: dict[str, str], *, cwd: str,
    stdio: list[int],
) -> tuple[StandbyWorker | None, str]:
    """Hand the rank to the first standby in ``directory`` that takes it. Returns the worker, or
    None with why (no standby was warm, or one declined: the others were started alike)."""
    try:
        candidates = sorted(p for p in directory.iterdir() if p.name.endswith(wire.SOCKET_SUFFIX))
    except OSError as exc:
        return None, f"no standby directory ({exc.strerror})"
    request = _request(kind, entrypoint, args, env, cwd)
    for path in candidates:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            conn.connect(str(path))
            conn.settimeout(REPLY_TIMEOUT_S)
            wire.send(conn, request, stdio)
            reply, _ = wire.receive(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue  # claimed by another rank a moment ago, or gone: try the next one
        pid = reply.get("pid")
        if isinstance(pid, int) and pid > 0:
            return StandbyWorker(conn, pid, str(path)), ""
        conn.close()
        return None, f"a standby declined: {reply.get('declined', 'no reason')}"
    return None, "no standby was warm"


def close_quietly(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
