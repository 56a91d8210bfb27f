"""The agent's warm standbys (``--standbys N``): keep N of them listening, start a fresh one for
each that a rank took, kill the idle ones when the agent stops. The protocol and why it keeps
isolation whole: node_agent/ranks/standby.py.

A standby belongs to the agent until it renames its socket ``<name>.sock`` to ``<name>.claimed``
(its claim), and to a rank from then on; the agent takes a warm one back by unlinking the socket.
One rename or unlink of one path wins, so the agent never kills a standby that has become a worker
(nor an attempt's process: a claimed one has its cgroup and uid), and one the agent is taking back
never becomes one.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.confinement.isolation import UidRange
from node_agent.ranks import standby_wire as wire
from node_agent.ranks.entry_points import STANDBY
from node_agent.ranks.standby import ZYGOTE_READY

PRELOAD = ("torch", "torch._dynamo", "worker_runtime", "worker_runtime.layouts")
"""What a standby imports before it waits: torch, the compiler stack that DDP's constructor and
``torch.use_deterministic_algorithms`` import on first use (about a second here), and the
platform's worker runtime. Platform code only, never a job's."""

FAILED_STARTS_LIMIT = 3
"""Standbys in a row that die before anyone claims them: the feature turns itself off, loudly
(a broken interpreter or a preload that starts threads would otherwise be restarted for ever)."""


STANDBY_SOCKET_NAME_MAX = len("/4194304-9999999999.sock.4194304.tmp")
"""The longest name a standby binds under its directory: ``<agent pid>-<serial>.sock`` (bound
first as ``.<standby pid>.tmp``), pids up to Linux's pid_max."""


def directory_name(node_name: str, pid: int) -> str:
    """The directory of one agent's standbys, ``<node name>-<agent pid>``: the agents of a machine
    share a run dir, and those of two dev clusters share node names."""
    return f"{re.sub(r'[^A-Za-z0-9._-]', '_', node_name)[:100].lstrip('.') or 'node'}-{pid}"


def remove_stale(parent: Path) -> None:
    """Remove the standby directories of agents that are gone (their standbys died with them)."""
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            pid = entry.name.rpartition("-")[2]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                shutil.rmtree(entry, ignore_errors=True)


IDLE_FOR_S = 3.0
"""How long a zygote started during a recovery imports at SCHED_IDLE before the agent puts it back
to normal priority: long enough to keep out of a recovery's way (the ranks starting then), short
enough that a node whose ranks keep every CPU busy still gets its standbys warm for the next failure."""

FORK_ANSWER_TIMEOUT_S = 5.0
"""How long the zygote may take to answer a fork with the standby's pid (a fork takes milliseconds);
past it the zygote is taken for broken and replaced."""


class _Zygote:
    """The process the pool's standbys are forked from (``standby --zygote``): it imports once."""

    def __init__(self, proc: subprocess.Popen[bytes], idle: bool) -> None:
        self.proc = proc
        self.ready = False
        self.idle_until = time.monotonic() + IDLE_FOR_S if idle else None
        self._pending = b""
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)

    def lines(self, timeout: float = 0.0) -> list[bytes]:
        """The lines it wrote since the last call, waiting up to ``timeout`` for the first."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        if timeout > 0 and b"\n" not in self._pending:
            _wait_readable(fd, timeout)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            self._pending += chunk
        *done, self._pending = self._pending.split(b"\n")
        return done

    def fork(self, socket: Path) -> int | None:
        """A standby listening (soon) on ``socket``: its pid, or None when the zygote did not answer."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(os.fsencode(socket) + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + FORK_ANSWER_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0 and self.proc.poll() is None:
            for line in self.lines(timeout=left):
                if line.strip().isdigit():
                    pid = int(line)
                    return pid if pid > 0 else None
        return None

    def close(self) -> None:
        """End it: the pipe closed, then killed (its unclaimed standbys die with it)."""
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _wait_readable(fd: int, timeout: float) -> bool:
    """``fd`` readable within ``timeout`` s (poll: an agent's descriptors may pass select's 1024)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout * 1000))))


@dataclass
class _Standby:
    pid: int
    pidfd: int | None
    """Its pidfd (it is the zygote's child, not the agent's): None once it is gone and closed."""
    socket: Path
    source: _Zygote
    """The zygote it was forked from."""

    @property
    def alive(self) -> bool:
        return self.pidfd is not None and not _wait_readable(self.pidfd, 0)

    @property
    def claimed(self) -> bool:
        return wire.claimed_path(self.socket).exists()

    @property
    def ours(self) -> bool:
        """Unclaimed and alive: listening (warm) or about to (no socket yet)."""
        return self.alive and not self.claimed

    def kill(self) -> None:
        if self.pidfd is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            _wait_readable(self.pidfd, 5)

    def forget(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


class StandbyPool:
    """``size`` standbys forked from one zygote, which imports the preloads once (an agent's start,
    and again only if it dies): a claimed standby is replaced by a fork, in milliseconds and with no
    CPU taken from the ranks then starting."""

    def __init__(
        self, *, size: int, directory: Path, python: str, env: dict[str, str], cwd: str,
        preload: tuple[str, ...] = PRELOAD, uids: UidRange | None = None, cgroup_base: Path | None = None,
        log: Any = None,
    ) -> None:
        if size < 0:
            raise ValueError("the number of standbys cannot be negative")
        self.size = size
        self.directory = directory
        self.python = python
        self.env = env
        self.cwd = cwd
        self.preload = preload
        self.uids = uids
        self.cgroup_base = cgroup_base
        self.log = log
        self._standbys: list[_Standby] = []
        self._zygote: _Zygote | None = None
        self._zygotes = 0
        self._serial = 0
        self._failed_in_a_row = 0
        self._lock = threading.Lock()
        """refill (the supervise loop's thread) against close (the agent's stop, which may not wait
        for that thread to end)."""
        self._closed = False
        self.disabled: str | None = None
        """Why the pool stopped starting standbys, if it did."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)  # worker uids list and connect; a standby checks who connects
        for stale in directory.iterdir():  # a previous instance's (its standbys died with it)
            with contextlib.suppress(OSError):
                stale.unlink()

    @property
    def kept(self) -> int:
        """The standbys that are the agent's: listening, or about to."""
        return sum(1 for s in self._standbys if s.ours)

    @property
    def warm(self) -> int:
        return sum(1 for s in self._standbys if s.ours and s.socket.exists())

    @property
    def zygote_pid(self) -> int | None:
        return self._zygote.proc.pid if self._zygote is not None else None

    def command(self, *, idle: bool = False) -> list[str]:
        command = [self.python, "-m", STANDBY, "--zygote", "--parent", str(os.getpid())]
        if idle:
            command.append("--idle")
        for name in self.preload:
            command += ["--preload", name]
        if self.uids is not None:
            command += ["--uids", f"{self.uids.first}-{self.uids.last}"]
        if self.cgroup_base is not None:
            command += ["--cgroup-base", str(self.cgroup_base)]
        return command

    def refill(self, *, hold: bool = False) -> None:
        """Forget the standbys that ended, note the ones claimed, fork new ones up to ``size``.
        ``hold``: a part of the node is starting, so a zygote that must be (re)started, which
        imports for seconds, waits for the next call; forks do not."""
        with self._lock:
            if not self._closed:
                self._refill(hold)

    def _refill(self, hold: bool) -> None:
        zygote = self._zygote
        if zygote is not None and zygote.proc.poll() is not None:
            # Its unclaimed standbys die with it: one failure, not theirs too.
            self._failed_in_a_row += 1
            zygote.close()
            self._zygote = zygote = None
        for standby in list(self._standbys):
            if standby.alive:
                continue
            self._standbys.remove(standby)
            standby.forget()
            if standby.claimed:
                self._failed_in_a_row = 0
            elif standby.source is self._zygote:
                self._failed_in_a_row += 1  # died unclaimed beside its live zygote: only close() kills one
            for path in (standby.socket, wire.claimed_path(standby.socket)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if self._failed_in_a_row >= FAILED_STARTS_LIMIT and self.disabled is None:
            self.disabled = f"{self._failed_in_a_row} standbys or zygotes in a row died before they were used"
            if self.log is not None:
                self.log.warning("standbys_disabled", reason=self.disabled, command=self.command())
            if zygote is not None:  # its idle standbys go with it
                zygote.close()
                self._zygote = zygote = None
        if self.disabled is not None:
            return
        if zygote is None:
            if hold:
                return
            # The first at normal priority; one that replaces a dead one at SCHED_IDLE, behind the
            # ranks that may be starting then (node_agent/ranks/standby.py, --idle).
            proc = subprocess.Popen(
                self.command(idle=self._zygotes > 0), env=self.env, cwd=self.cwd, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            )
            self._zygotes += 1
            self._zygote = zygote = _Zygote(proc, idle=self._zygotes > 1)
        if zygote.idle_until is not None and time.monotonic() >= zygote.idle_until:
            zygote.idle_until = None
            with contextlib.suppress(OSError):
                os.sched_setscheduler(zygote.proc.pid, os.SCHED_OTHER, os.sched_param(0))
        if not zygote.ready:
            zygote.ready = any(line.strip() == ZYGOTE_READY for line in zygote.lines())
            if not zygote.ready:
                return  # still importing
        if zygote.idle_until is not None:
            return  # at SCHED_IDLE on busy CPUs it may not answer a fork soon: forks once it is back
        while self.kept < self.size and self._fork(zygote):
            pass

    def _fork(self, zygote: _Zygote) -> bool:
        self._serial += 1
        socket = self.directory / f"{os.getpid()}-{self._serial}{wire.SOCKET_SUFFIX}"
        pid = zygote.fork(socket)
        if pid is None:
            zygote.proc.kill()  # taken for dead: the next refill replaces it
            return False
        try:
            pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            pidfd = None  # gone already: counted as dead unclaimed at the next refill
        if pidfd is not None and _parent_of(pid) != zygote.proc.pid:
            # Died and reaped by the zygote before the pidfd was open, its pid taken by another
            # process since: not ours to watch, let alone kill.
            os.close(pidfd)
            pidfd = None
        self._standbys.append(_Standby(pid, pidfd, socket, zygote))
        return pidfd is not None

    def close(self) -> None:
        """Kill every standby that is still the agent's, and the zygote; leave those ranks took."""
        with self._lock:
            self._closed = True
            self._close()

    def _close(self) -> None:
        for standby in self._standbys:
            with contextlib.suppress(FileNotFoundError):
                standby.socket.unlink()  # taken back: it can no longer be claimed
            if not standby.claimed:  # a rank's now otherwise (one with no socket yet cannot be claimed)
                standby.kill()
            standby.forget()
        self._standbys.clear()
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None
        # Claimed sockets stay (a worker's parent may still hold one); the directory goes once empty.
        for path in self.directory.glob(f"*{wire.SOCKET_SUFFIX}"):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()
