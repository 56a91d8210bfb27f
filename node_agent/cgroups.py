"""One cgroup v2 per attempt part: where its processes are counted and how all of them are stopped.

A process stays in its cgroup whatever it does (setsid, a scrubbed environment, a double fork):
moving it out takes write access to another cgroup's ``cgroup.procs``, and only the agent (root)
has that. So the attempt's processes are exactly the cgroup's, and ``cgroup.kill`` ends every one
of them at once, escapees included.

Layout, under the agent's own cgroup in the unified (v2) hierarchy::

    <agent's cgroup>/trainyard/node-<node id>/<attempt id>.<node rank>/

Several agents on one machine (a dev cluster) share ``trainyard/``; a node's directory holds only
its own attempts, which is how a new agent instance finds the orphans of an earlier one. Nothing
here enables a controller: the cgroups are for tracking, and limits belong to the container that
production runs each part in (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

PARENT = "trainyard"


def cgroup2_dir(mountinfo: str, self_cgroup: str) -> Path | None:
    """This process's cgroup directory in the unified hierarchy, from the text of
    /proc/self/mountinfo and /proc/self/cgroup; None without a cgroup2 mount."""
    mount = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" in fields:
            sep = fields.index("-")
            if len(fields) > sep + 1 and fields[sep + 1] == "cgroup2" and len(fields) > 4:
                mount = fields[4]
                break
    own = next((line[3:] for line in self_cgroup.splitlines() if line.startswith("0::")), None)
    if mount is None or own is None:
        return None
    # The agent's own cgroup, seen from the mount (a container sees "/" for its namespace root).
    return Path(mount) / own.strip().lstrip("/")


def _read(path: Path) -> str:
    return path.read_text()


@dataclass(frozen=True)
class AttemptCgroup:
    path: Path

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def pids(self) -> set[int]:
        """Every process in the cgroup and below it (a worker cannot make sub-cgroups, but an
        operator might); empty once the cgroup is gone."""
        found: set[int] = set()
        try:
            walk = list(os.walk(self.path))
        except OSError:
            return found
        for root, _dirs, files in walk:
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    found |= {int(p) for p in _read(Path(root) / "cgroup.procs").split()}
        return found

    def signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGKILL and self.kill():
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def kill(self) -> bool:
        """SIGKILL every process at once (cgroup.kill, Linux 5.14+); False when not supported."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except FileNotFoundError:
            return not self.path.exists()
        except OSError:
            return False
        return True

    def remove(self) -> bool:
        """Remove the (empty) cgroup; False while it still holds processes."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno in (errno.EBUSY, errno.ENOTEMPTY):
                return False
            raise
        return True


class CgroupTree:
    """The agent's attempt cgroups: ``<base>/node-<node id>/<attempt id>.<node rank>``."""

    def __init__(self, base: Path) -> None:
        self.base = base

    @classmethod
    def detect(cls) -> tuple[CgroupTree | None, str]:
        """The tree under this process's cgroup when the unified hierarchy is mounted and writable
        here, else None; with why, for the agent's log."""
        try:
            own = cgroup2_dir(_read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")))
        except OSError as exc:
            return None, f"cannot read /proc: {exc}"
        if own is None:
            return None, "no cgroup v2 (unified) hierarchy is mounted"
        base = own / PARENT
        probe = base / f".probe-{os.getpid()}"
        try:
            probe.mkdir(parents=True, exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            return None, f"cgroup v2 at {own} is not writable by the agent: {exc}"
        return cls(base), f"cgroup v2 at {base}"

    def node_dir(self, node_id: str) -> Path:
        return self.base / f"node-{node_id}"

    def for_part(self, node_id: str, attempt_id: str, node_rank: int) -> AttemptCgroup:
        return AttemptCgroup(self.node_dir(node_id) / f"{attempt_id}.{node_rank}")

    def parts(self, node_id: str) -> dict[str, AttemptCgroup]:
        """This node's attempt cgroups by attempt id (what the orphan sweep looks at)."""
        found: dict[str, AttemptCgroup] = {}
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.node_dir(node_id)):
                if entry.is_dir(follow_symlinks=False):
                    attempt_id = entry.name.rpartition(".")[0]
                    if attempt_id:
                        found[attempt_id] = AttemptCgroup(Path(entry.path))
        return found
