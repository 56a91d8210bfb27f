"""Which processes belong to an attempt, and how to signal all of them.

A confined attempt (node_agent/confinement/isolation.py) is found by its cgroup or its uid, which its processes
cannot leave. What follows is the fallback for an agent that cannot confine (not root, no
writable cgroup v2), whose workers run as the agent's own user.

An attempt is not one process group: torchrun starts every rank in a session of its own, and a
worker may start more sessions. What every process of an attempt does share is its environment:
TRAINYARD_ATTEMPT_ID, inherited from torchrun by the shims, the workers and their children, even
after torchrun or the agent died and they were reparented. A scan of this user's processes by
that variable, plus every member of the process groups those processes lead or share (children
that scrubbed their environment), finds them all. The attempt counts as alive while that set is
not empty; only then may the control plane reuse its GPUs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainyard.protocol.env import ENV_ATTEMPT_ID, ENV_NODE_ID, ENV_NODE_RANK


@dataclass
class ProcessTable:
    """One scan of this user's live (non-zombie) processes."""

    by_attempt: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    # (attempt id, node rank): several agents on one machine (a dev cluster) run parts of the same
    # attempt as the same user, and each must find and signal only its own part.
    by_part: dict[tuple[str, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    # (node name, attempt id): what a new agent instance of a node sweeps for orphans.
    by_node: dict[tuple[str, str], set[int]] = field(default_factory=lambda: defaultdict(set))
    by_pgid: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    pgid_of: dict[int, int] = field(default_factory=dict)
    by_uid: dict[int, set[int]] = field(default_factory=lambda: defaultdict(set))
    """Processes by each of their uids (real, effective, saved): a confined attempt's are its uid's."""
    started: dict[int, float] = field(default_factory=dict)
    """Each pid's start time (psutil create_time): with the pid, a process's identity (pids and
    process-group ids are reused)."""

    def same_process(self, pid: int, create_time: float | None) -> bool:
        """True if `pid` is in this scan and is the process that started at `create_time`."""
        started = self.started.get(pid)
        return started is not None and create_time is not None and abs(started - create_time) < 0.5


def scan() -> ProcessTable:
    table = ProcessTable()
    uid, me = os.getuid(), os.getpid()
    for proc in psutil.process_iter(["uids", "status", "create_time"]):
        info = proc.info
        uids = info.get("uids")
        # Zombies hold nothing (and in containers whose init does not reap, they linger forever).
        if proc.pid == me or info.get("status") == psutil.STATUS_ZOMBIE or uids is None:
            continue
        if uid != 0 and uids.real != uid:
            continue  # another user's process: not ours to find, nor to kill
        for each in {uids.real, uids.effective, uids.saved}:
            table.by_uid[each].add(proc.pid)
        if info.get("create_time") is not None:
            table.started[proc.pid] = info["create_time"]
        try:
            pgid = os.getpgid(proc.pid)
            env = proc.environ()
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
        table.pgid_of[proc.pid] = pgid
        table.by_pgid[pgid].add(proc.pid)
        attempt_id = env.get(ENV_ATTEMPT_ID)
        if attempt_id:
            table.by_attempt[attempt_id].add(proc.pid)
            table.by_part[(attempt_id, env.get(ENV_NODE_RANK, ""))].add(proc.pid)
            if env.get(ENV_NODE_ID):
                table.by_node[(env[ENV_NODE_ID], attempt_id)].add(proc.pid)
    return table


def uids_alive() -> set[int]:
    """The uids (real, effective, saved) of every live process this agent can see."""
    found: set[int] = set()
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info.get("uids")
        if uids is not None and proc.info.get("status") != psutil.STATUS_ZOMBIE:
            found |= {uids.real, uids.effective, uids.saved}
    return found


def signal_processes(pids: Iterable[int], pgids: Iterable[int], sig: signal.Signals) -> None:
    me = os.getpid()
    for pgid in pgids:
        if pgid != os.getpgid(0):  # never our own group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
    for pid in pids:
        if pid != me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)


def boot_id() -> str | None:
    """This boot's id (Linux): a pid, pgid or start time saved before a reboot means nothing now."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def process_create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def pid_alive(pid: int, create_time: float | None = None) -> bool:
    """True if `pid` is a live non-zombie process (started at `create_time`, when given: pids are
    reused)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(proc.create_time() - create_time) < 0.5
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
