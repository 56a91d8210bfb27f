"""Wake the supervise loop when what it polls for happens, rather than at its next poll.

Supervision (loops/supervise.py) learns of a worker's start and exit from its rank shim's file and
of an attempt's end from its processes, every ``poll_interval_s`` (0.25 s: where parts have cgroups
it reads only theirs, but without cgroups it scans all of /proc, tens of milliseconds on a busy node,
so it cannot simply poll faster). Three of those moments are on
a recovery's critical path: the failed worker's exit (detection), every process of the failed
attempt gone on every node (its GPUs are released then, so the next attempt is placed then:
decision) and every worker of the new attempt running (process start). Each cost half a poll on
average. So the agent also watches, in one thread and one epoll set:

- each attempt's rank-file directory (inotify: a shim replaces its file by a rename), and
- torchrun's and each running worker's pid (pidfd: readable once the process has exited),

and wakes the supervise loop when any fires (at most once per ``MIN_GAP_S``); the loop then looks
as it always does. The poll stays:
a missed or unavailable watch (an old kernel, a directory not there yet) costs only the old delay.
Linux only, as the agent is; standard library (inotify through libc).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

MIN_GAP_S = 0.1
"""Wakes are at least this far apart: the status directory is the workers', and a worker renaming
files in a loop must not make the agent scan /proc without pause (at most one extra scan per gap)."""

MAX_PIDS = 256
"""At most this many pidfds are held: a job that forks thousands of processes must not exhaust the
agent's descriptors; past it, the processes beyond are noticed by the poll."""

_IN_MOVED_TO = 0x00000080
_IN_ONLYDIR = 0x01000000
_IN_DONT_FOLLOW = 0x02000000  # the directory is the workers': never a link they planted
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


class SuperviseWakeups:
    """Calls ``wake`` from its own thread when a watched pid exits or a watched directory gets a file."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._epoll = select.epoll()
        self._lock = threading.Lock()
        self._pids: dict[int, int] = {}  # pid -> pidfd
        self._fd_pid: dict[int, int] = {}  # pidfd -> pid
        self._dirs: dict[str, int] = {}  # directory -> inotify watch descriptor
        self._inotify = _inotify_init()
        if self._inotify is not None:
            self._epoll.register(self._inotify, select.EPOLLIN)
        self._stop_r, self._stop_w = os.pipe()
        self._epoll.register(self._stop_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="agent-supervise-wake", daemon=True)
        self._thread.start()

    def watch_pids(self, pids: Iterable[int]) -> None:
        """Watch these pids, in this order, until each exits (a pid already watched is left as is),
        up to MAX_PIDS in all."""
        with self._lock:
            for pid in dict.fromkeys(pids):
                if pid in self._pids:
                    continue
                if len(self._pids) >= MAX_PIDS:
                    break
                try:
                    fd = os.pidfd_open(pid)
                except (OSError, AttributeError):
                    continue  # gone already (the next poll sees it), or no pidfds here
                self._pids[pid], self._fd_pid[fd] = fd, pid
                self._epoll.register(fd, select.EPOLLIN)

    def watch_dir(self, directory: Path) -> None:
        """Wake when a file is renamed into ``directory`` (a shim replaced its rank file)."""
        key = str(directory)
        with self._lock:
            if self._inotify is None or key in self._dirs:
                return
            wd = _LIBC.inotify_add_watch(self._inotify, os.fsencode(key), _IN_MOVED_TO | _IN_ONLYDIR | _IN_DONT_FOLLOW)
            if wd >= 0:
                self._dirs[key] = wd

    def forget_dir(self, directory: Path) -> None:
        with self._lock:
            wd = self._dirs.pop(str(directory), None)
            if wd is not None and self._inotify is not None:
                _LIBC.inotify_rm_watch(self._inotify, wd)  # fails harmlessly once the directory is gone

    @property
    def watched_pids(self) -> set[int]:
        with self._lock:
            return set(self._pids)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        self._thread.join(5)
        with self._lock:
            for fd in [*self._fd_pid, *(f for f in (self._inotify, self._stop_r, self._stop_w) if f is not None)]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._pids.clear()
            self._fd_pid.clear()
            self._epoll.close()

    def _run(self) -> None:
        while True:
            try:
                events = self._epoll.poll()
            except (OSError, ValueError):
                return  # closed
            fired = False
            for fd, _ in events:
                if fd == self._stop_r:
                    return
                if fd == self._inotify:
                    with contextlib.suppress(BlockingIOError, OSError):
                        while os.read(fd, 64 * _EVENT.size):  # drain: one wake for a burst of events
                            pass
                    fired = True
                    continue
                with self._lock:
                    pid = self._fd_pid.pop(fd, None)
                    if pid is not None:
                        self._pids.pop(pid, None)
                        with contextlib.suppress(OSError, ValueError):
                            self._epoll.unregister(fd)
                        os.close(fd)
                fired = True
            if fired:
                self._wake()
                time.sleep(MIN_GAP_S)  # what fires meanwhile is picked up by the next poll() at once


_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _inotify_init() -> int | None:
    try:
        fd = int(_LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
    except AttributeError:
        return None
    return fd if fd >= 0 else None
