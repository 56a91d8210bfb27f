"""Setting a part's resource limits on this machine and noticing when it hits one (issue 23, finding 6).

The policy (what a part may use) is node_agent/confinement/limits.py; the cgroups are node_agent/confinement/cgroups.py.
Here: the agent's own protection from the OOM killer, each part's /dev/shm tmpfs, the work
directory's measure, and the checks the part's supervision makes (``PartLimiter.check``).

Why the work directory is measured rather than enforced by the kernel: a per-part file system
(a loop-mounted image, a project quota) needs loop devices or quota-enabled mounts that containers
and CI runners rarely have, and a tmpfs would put the part's files in RAM. The agent walks the
directory every WORK_DIR_CHECK_S (or WALK_BACKOFF times as long as its last walk took) and stops
the part once it holds more than its cap (or MAX_WORK_DIR_FILES entries): the cap can be
overshot by what the part writes in that time, which the agent's ``--min-free-mb`` check and the
node's reserve absorb. /dev/shm is a tmpfs of the part's own size: the kernel enforces it (ENOSPC).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from pathlib import Path

from node_agent.confinement.cgroups import AttemptCgroup, LimitGroups, LimitTree
from node_agent.confinement.limits import (
    LimitEvents,
    LimitOptions,
    NodeResources,
    PartLimits,
    limit_reason,
    part_limits,
    shm_reason,
    work_dir_reason,
)
from node_agent.confinement.short_tmp import short_tmp

AGENT_OOM_SCORE_ADJ = -1000
"""The agent is never the OOM killer's choice: it is what stops a part that went over."""
WORKER_OOM_SCORE_ADJ = 500
"""A part's processes are the first choice, whatever else runs on the node."""
WORK_DIR_CHECK_S = 2.0
MAX_WORK_DIR_FILES = 500_000
"""Entries a part's work directory may hold: each walk reads them all, and a node's inodes are
shared. Past it the part is stopped, as past its bytes."""
WALK_BACKOFF = 20
"""The next walk waits at least this many times as long as the last one took: a large tree costs
the supervision loop a few per cent at most."""
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def protect_agent() -> str | None:
    """Make this process the OOM killer's last choice; None when done, else why not."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(AGENT_OOM_SCORE_ADJ))
    except OSError as exc:
        return f"cannot set the agent's oom_score_adj to {AGENT_OOM_SCORE_ADJ}: {exc}"
    return None


def node_resources(work_dir: Path, gpus: int) -> NodeResources:
    """The node's memory, CPUs (those this process may use) and work directory file system size."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    existing = next((p for p in (work_dir, *work_dir.absolute().parents) if p.exists()), Path("/"))
    try:
        space = shutil.disk_usage(existing).total  # the directory itself may not be made yet
    except OSError:
        space = 0
    return NodeResources(memory=memory, cpus=cpus, gpus=gpus, work_dir_space=space)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def mount_shm(path: Path, size: int, uid: int | None, gid: int | None) -> None:
    """A tmpfs of ``size`` bytes at ``path``, private to the part's uid (raises OSError)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    owner = f",uid={uid},gid={gid},mode=0700" if uid is not None and gid is not None else ",mode=1777"
    data = f"size={size}{owner}"
    if _libc().mount(b"tmpfs", str(path).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, data.encode()) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount tmpfs on {path}: {os.strerror(errno)}")


def unmount_shm(path: Path) -> None:
    """Detach the tmpfs (its pages go once no process of the part holds a file of it) and remove
    the mount point; quiet when it is not mounted."""
    _libc().umount2(str(path).encode(), _MNT_DETACH)
    with contextlib.suppress(OSError):
        path.rmdir()


def shm_full(path: Path) -> bool:
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    return stat.f_bavail == 0 or stat.f_favail == 0


def disk_used(path: Path, limit: int) -> tuple[int, int]:
    """Bytes of disk the tree at ``path`` holds (st_blocks, no link followed) and its entries; it
    stops counting past ``limit`` bytes or MAX_WORK_DIR_FILES entries (the answer is then over)."""
    used, seen = 0, 0
    stack = [str(path)]
    while stack and used <= limit and seen <= MAX_WORK_DIR_FILES:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            with contextlib.suppress(OSError):
                info = entry.stat(follow_symlinks=False)
                used += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
    return used, seen


class PartLimiter:
    """This agent's limits: what each part gets, where the kernel enforces it, what it hit."""

    def __init__(self, tree: LimitTree | None, options: LimitOptions, node: NodeResources, shm_root: Path | None
                 ) -> None:
        self.tree = tree
        self.options = options
        self.node = node
        self.shm_root = shm_root

    def limits_for(self, gpus: int) -> PartLimits:
        return part_limits(self.node, gpus, self.options)

    def apply(self, tracking: AttemptCgroup | None, node_id: str, attempt_id: str, node_rank: int, gpus: int,
              uid: int | None, gid: int | None) -> tuple[PartLimits, LimitGroups | None, Path | None]:
        """The part's limits, its limit cgroups (made and written) and its /dev/shm (mounted).
        Raises OSError (the part then fails, saying so); what was made is undone first."""
        limits = self.limits_for(gpus)
        groups = shm = None
        try:
            if self.tree is not None:
                groups = self.tree.for_part(tracking, node_id, attempt_id, node_rank)
                groups.apply(limits.memory, limits.pids, limits.cpus, limits.cpu_weight)
            if self.shm_root is not None and limits.shm is not None:
                shm = self.shm_root / f"{attempt_id}.{node_rank}"
                mount_shm(shm, limits.shm, uid, gid)
        except OSError:
            self.release(groups, shm)
            raise
        return limits, groups, shm

    @staticmethod
    def check(limits: PartLimits | None, groups: LimitGroups | None, shm: Path | None, worker_dir: Path | None
              ) -> str | None:
        """Why the part must stop now (a limit it hit), or None. ``worker_dir``: walk it too (its
        caller does so at most every WORK_DIR_CHECK_S)."""
        if limits is None:
            return None
        if groups is not None:
            oom, pids = groups.counters()
            reason = limit_reason(limits, LimitEvents(oom_kills=oom, pids_max_hits=pids))
            if reason is not None:
                return reason
        if shm is not None and limits.shm is not None and shm_full(shm):
            return shm_reason(limits)
        if limits.work_dir is not None and worker_dir is not None:
            used, files = disk_used(worker_dir, limits.work_dir)
            # Its TMPDIR, where it is a short directory of its own outside the worker directory (a
            # DataLoader's sockets must fit in 108 bytes: isolation.py), counts against the same cap.
            tmp = short_tmp(worker_dir)
            if used <= limits.work_dir and tmp.is_dir() and not tmp.is_symlink():
                more, more_files = disk_used(tmp, limits.work_dir - used)
                used, files = used + more, files + more_files
            if used > limits.work_dir:
                return work_dir_reason(limits, used)
            if files > MAX_WORK_DIR_FILES:
                return (f"file limit: the part's work directory holds more than {MAX_WORK_DIR_FILES} entries; "
                        "the part was stopped")
        return None

    @staticmethod
    def release(groups: LimitGroups | None, shm: Path | None) -> None:
        """After the last process of the part is gone."""
        if groups is not None:
            groups.remove()
        if shm is not None:
            unmount_shm(shm)
