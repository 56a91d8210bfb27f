"""Every process a test's own descendants start, with the uid each ran as: the Linux proc connector
(CN_PROC over netlink, root only) reports each fork, exec, uid change and exit as it happens, so a
short-lived process (an interpreter probe, pip) cannot be missed. Lost events (the socket's buffer
overflowed) fail the recording instead of passing silently.

    with ProcRecorder() as recorder:
        ...start things...
    recorder.execs  # [Exec(pid, uid, cmdline), ...] of os.getpid()'s descendants
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

_NETLINK_CONNECTOR, _CN_IDX_PROC, _CN_VAL_PROC = 11, 1, 1
_NLMSG_DONE, _PROC_CN_MCAST_LISTEN, _PROC_CN_MCAST_IGNORE = 3, 1, 2
_FORK, _EXEC, _UID, _EXIT = 0x1, 0x2, 0x4, 0x80000000
_SO_RCVBUFFORCE = 33
_HEADERS = 16 + 20  # nlmsghdr + cn_msg


@dataclass
class Exec:
    pid: int
    uid: int
    """The effective uid the new program started with."""
    cmdline: list[str] | None
    """Read as the event arrived (None: the process had gone or changed again)."""
    uid_when_read: int | None
    """The process's uid when cmdline was read: the cmdline is the exec's only while it is ``uid``."""
    environ: dict[str, str] | None = None
    """Its environment, read with the cmdline (None: it could not be)."""


@dataclass
class ProcRecorder:
    root: int = field(default_factory=os.getpid)
    execs: list[Exec] = field(default_factory=list)
    sequence: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    """Per process: ('fork', child) / ('exec', uid) / ('uid', euid) in the order they happened."""
    lost: str | None = None
    _uids: dict[int, int] = field(default_factory=dict)
    _sock: Any = None
    _thread: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> ProcRecorder:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 32 * 2**20)
        sock.bind((0, _CN_IDX_PROC))
        sock.settimeout(0.2)
        self._sock = sock
        self._uids[self.root] = os.geteuid()
        self._send(_PROC_CN_MCAST_LISTEN)
        self._thread = threading.Thread(target=self._listen, name="proc-events", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        with contextlib.suppress(OSError):
            self._send(_PROC_CN_MCAST_IGNORE)
        self._sock.close()

    def _send(self, op: int) -> None:
        message = struct.pack("=IIIIHHI", _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, 4, 0, op)
        self._sock.send(struct.pack("=IHHII", 16 + len(message), _NLMSG_DONE, 0, 0, 0) + message)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError as exc:  # ENOBUFS: events were dropped
                self.lost = str(exc)
                continue
            self._handle(data)

    def _handle(self, data: bytes) -> None:
        if len(data) < _HEADERS + 16:
            return
        what = struct.unpack_from("=I", data, _HEADERS)[0]
        body = _HEADERS + 16  # what, cpu, timestamp
        if what == _FORK:
            _, parent_tgid, child_pid, child_tgid = struct.unpack_from("=iiii", data, body)
            if parent_tgid in self._uids and child_pid == child_tgid and child_tgid not in self._uids:
                self._uids[child_tgid] = self._uids[parent_tgid]
                self.sequence.setdefault(parent_tgid, []).append(("fork", child_tgid))
        elif what == _EXEC:
            _, tgid = struct.unpack_from("=ii", data, body)
            if tgid in self._uids and tgid != self.root:
                uid = self._uids[tgid]
                self.sequence.setdefault(tgid, []).append(("exec", uid))
                self.execs.append(Exec(tgid, uid, *_read(tgid)))
        elif what == _UID:
            _, tgid, _ruid, euid = struct.unpack_from("=iiII", data, body)
            if tgid in self._uids and tgid != self.root:
                self._uids[tgid] = euid
                self.sequence.setdefault(tgid, []).append(("uid", euid))

    def root_execs_not_wrappers(self, wrapper: str) -> list[str]:
        """Every exec as uid 0 that was not the confine wrapper dropping to a uid before doing
        anything else: a second exec or a fork while still root, a cmdline read as root that is not
        ``wrapper``'s, or a root exec never followed by a switch."""
        bad = []
        for pid, events in self.sequence.items():
            for index, (kind, uid) in enumerate(events):
                if kind != "exec" or uid != 0:
                    continue
                following = events[index + 1:]
                if not following or following[0][0] != "uid" or following[0][1] == 0:
                    bad.append(f"pid {pid} exec'd as root and then {following[:1] or 'nothing'}, not a uid switch")
        for item in self.execs:
            if item.uid == 0 and item.uid_when_read == 0 and (item.cmdline is None or wrapper not in item.cmdline):
                bad.append(f"pid {item.pid} ran {item.cmdline} as root")
        return bad


def _read(pid: int) -> tuple[list[str] | None, int | None, dict[str, str] | None]:
    try:
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[2]) for line in f if line.startswith("Uid:"))
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.decode(errors="replace").partition("=") for item in f.read().split(b"\0") if item]
        with open(f"/proc/{pid}/status") as f:
            again = next(int(line.split()[2]) for line in f if line.startswith("Uid:"))
    except (OSError, StopIteration, ValueError):
        return None, None, None
    if again != uid:
        return None, None, None
    return [a.decode(errors="replace") for a in args if a], uid, {k: v for k, _, v in pairs}
