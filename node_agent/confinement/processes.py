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

A process in an attempt cgroup (``trainyard/node-<node id>/<attempt id>.<node rank>``, any agent's on
this machine) is that part's by its cgroup, which it cannot leave, and its environment is not read:
reading ``/proc/<pid>/environ`` waits on the process's memory map lock, which a process that keeps
forking holds most of the time. Beside a fork bomb held at its part's pids limit, a scan that read
every environment took tens of seconds (a registration's, the supervise loop's, on every agent of
the node); its processes' cgroup files read at once (bench/process_scan.py measures both).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from node_agent.confinement.cgroups import PARENT
from trainyard.protocol.env import ENV_ATTEMPT_ID, ENV_NODE_ID, ENV_NODE_RANK

_PART_CGROUP = re.compile(rf"/{PARENT}/node-(?P<node>[^/]+)/(?P<attempt>[^/]+)\.(?P<rank>\d+)(?:/|$)")
"""A part's cgroup in the unified hierarchy (cgroups.CgroupTree), as /proc/<pid>/cgroup names it."""
_PART_MARK = f"/{PARENT}/node-".encode()


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


_ATTRS = ["uids", "status", "create_time"]


def scan(only: Iterable[int] | None = None) -> ProcessTable:
    """This user's live processes (every one, as root), or only those of ``only`` that are alive:
    a confined part's are known from its cgroup, and the agent's supervision, four times a second,
    looks at them alone rather than at every process of the machine."""
    table = ProcessTable()
    uid, me = os.getuid(), os.getpid()
    for proc in psutil.process_iter(_ATTRS) if only is None else _processes(only):
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
            marker = part_of(proc.pid)
            if marker is None:
                env = proc.environ()
                marker = (env.get(ENV_NODE_ID, ""), env.get(ENV_ATTEMPT_ID, ""), env.get(ENV_NODE_RANK, ""))
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
        table.pgid_of[proc.pid] = pgid
        table.by_pgid[pgid].add(proc.pid)
        node_id, attempt_id, node_rank = marker
        if attempt_id:
            table.by_attempt[attempt_id].add(proc.pid)
            table.by_part[(attempt_id, node_rank)].add(proc.pid)
            if node_id:
                table.by_node[(node_id, attempt_id)].add(proc.pid)
    return table


def _processes(pids: Iterable[int]) -> Iterable[psutil.Process]:
    """What psutil.process_iter yields (``info`` read at once), for these pids only."""
    for pid in sorted(set(pids)):
        try:
            proc = psutil.Process(pid)
            proc.info = proc.as_dict(_ATTRS)
        except psutil.Error:
            continue
        yield proc


def part_of(pid: int) -> tuple[str, str, str] | None:
    """(node id, attempt id, node rank) of the part whose cgroup holds ``pid``; None outside every
    part's cgroup (or without cgroup v2). Raises ProcessLookupError when the process is gone. Called
    for every process of every scan: bytes, and no regex unless the path names a part."""
    try:
        fd = os.open(f"/proc/{pid}/cgroup", os.O_RDONLY)
    except FileNotFoundError as exc:
        raise ProcessLookupError(pid) from exc
    except OSError:
        return None
    try:
        data = os.read(fd, 1 << 16)
    except OSError:
        return None
    finally:
        os.close(fd)
    if _PART_MARK not in data:
        return None
    own = next((line[3:] for line in data.splitlines() if line.startswith(b"0::")), b"")
    match = _PART_CGROUP.search(own.decode(errors="replace"))
    return (match["node"], match["attempt"], match["rank"]) if match else None


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
