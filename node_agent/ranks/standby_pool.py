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
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node_agent.confinement.isolation import UidRange
from node_agent.ranks import standby_wire as wire
from node_agent.ranks.entry_points import STANDBY

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
"""How long a replacement standby imports at SCHED_IDLE before the agent puts it back to normal
priority: long enough to keep out of a recovery's way (the ranks starting then), short enough that a
node whose ranks keep every CPU busy still has its standbys warm for the next failure."""


@dataclass
class _Standby:
    proc: subprocess.Popen[bytes]
    socket: Path
    idle_until: float | None = None
    """While importing at SCHED_IDLE: when the agent moves it back to normal priority."""

    @property
    def claimed(self) -> bool:
        return wire.claimed_path(self.socket).exists()

    @property
    def ours(self) -> bool:
        """Unclaimed and alive: listening (warm) or still importing (no socket yet)."""
        return self.proc.poll() is None and not self.claimed


class StandbyPool:
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
        self._serial = 0
        self._failed_in_a_row = 0
        self.disabled: str | None = None
        """Why the pool stopped starting standbys, if it did."""
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o755)  # worker uids list and connect; a standby checks who connects
        for stale in directory.iterdir():  # a previous instance's (its standbys died with it)
            with contextlib.suppress(OSError):
                stale.unlink()

    @property
    def kept(self) -> int:
        """The standbys that are the agent's: listening, or still importing."""
        return sum(1 for s in self._standbys if s.ours)

    @property
    def warm(self) -> int:
        return sum(1 for s in self._standbys if s.ours and s.socket.exists())

    def command(self, socket: Path, *, idle: bool = False) -> list[str]:
        command = [self.python, "-m", STANDBY, "--socket", str(socket), "--parent", str(os.getpid())]
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
        """Reap the standbys that ended, note the ones claimed, start new ones up to ``size``
        (``hold``: not now, a part of the node is starting; the next call does)."""
        for standby in list(self._standbys):
            if standby.proc.poll() is None:
                continue
            self._standbys.remove(standby)
            if standby.claimed:
                self._failed_in_a_row = 0
            elif standby.proc.returncode != 0:
                self._failed_in_a_row += 1
            for path in (standby.socket, wire.claimed_path(standby.socket)):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        if self._failed_in_a_row >= FAILED_STARTS_LIMIT and self.disabled is None:
            self.disabled = f"{self._failed_in_a_row} standbys in a row died before they were used"
            if self.log is not None:
                self.log.warning("standbys_disabled", reason=self.disabled, command=self.command(Path("…")))
        if self.disabled is not None:
            return
        now = time.monotonic()
        for standby in self._standbys:
            if standby.idle_until is not None and now >= standby.idle_until:
                standby.idle_until = None
                if standby.ours:  # importing, or warm and waiting: a claim must not run at idle priority
                    with contextlib.suppress(OSError):
                        os.sched_setscheduler(standby.proc.pid, os.SCHED_OTHER, os.sched_param(0))
        while not hold and sum(1 for s in self._standbys if s.ours) < self.size:
            # The first fill at normal priority; each replacement of a taken one at SCHED_IDLE,
            # behind the ranks that are starting then (node_agent/ranks/standby.py, --idle).
            self._start(idle=self._serial >= self.size)

    def _start(self, *, idle: bool = False) -> None:
        self._serial += 1
        socket = self.directory / f"{os.getpid()}-{self._serial}{wire.SOCKET_SUFFIX}"
        proc = subprocess.Popen(
            self.command(socket, idle=idle), env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        self._standbys.append(_Standby(proc, socket, time.monotonic() + IDLE_FOR_S if idle else None))

    def close(self) -> None:
        """Kill every standby that is still the agent's; leave those ranks took."""
        for standby in self._standbys:
            with contextlib.suppress(FileNotFoundError):
                standby.socket.unlink()  # taken back: it can no longer be claimed
            if standby.claimed:
                continue  # a rank's now (a standby still importing has no socket to be claimed by)
            with contextlib.suppress(ProcessLookupError):
                standby.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                standby.proc.wait(5)
        self._standbys.clear()
        # Claimed sockets stay (a worker's parent may still hold one); the directory goes once empty.
        for path in self.directory.glob(f"*{wire.SOCKET_SUFFIX}"):
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.directory.rmdir()
