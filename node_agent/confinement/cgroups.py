"""One cgroup v2 per attempt part: where its processes are counted and how all of them are stopped.

A process stays in its cgroup whatever it does (setsid, a scrubbed environment, a double fork):
moving it out takes write access to another cgroup's ``cgroup.procs``, and only the agent (root)
has that. So the attempt's processes are exactly the cgroup's, and ``cgroup.kill`` ends every one
of them at once, escapees included.

Layout, under the agent's own cgroup in the unified (v2) hierarchy::

    <agent's cgroup>/trainyard/node-<node id>/<attempt id>.<node rank>/

Several agents on one machine (a dev cluster) share ``trainyard/``; a node's directory holds only
its own attempts, which is how a new agent instance finds the orphans of an earlier one.

Limits (issue 23, finding 6; the policy is node_agent/confinement/limits.py): where the unified hierarchy offers
the memory, pids and cpu controllers, they are enabled down to each part's cgroup and the limits
are written there. A machine that keeps those controllers in cgroup v1 hierarchies (a hybrid
layout) gets a cgroup per part in each of them instead, beside the v2 one that tracks it
(``LimitTree``); a part's processes join all of them before the uid switch (confine_exec.py).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

PARENT = "trainyard"
CONTROLLERS = ("memory", "pids", "cpu")
AGENT_LEAF = "trainyard-agent"
"""Where the agent moves the processes of its own cgroup so that the cgroup may delegate
controllers to its attempts' tree (the cgroup v2 "no internal processes" rule)."""
CPU_PERIOD_US = 100_000


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
        if own.name == AGENT_LEAF:  # moved there by an earlier agent, to delegate controllers
            own = own.parent
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


# --- limits (issue 23, finding 6) ---


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _counter(text: str, key: str) -> int:
    """The value of ``key N`` in a flat keyed file (memory.events, pids.events, memory.oom_control)."""
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def cgroup1_dirs(mountinfo: str, self_cgroup: str) -> dict[str, Path]:
    """This process's cgroup directory in each cgroup v1 hierarchy of CONTROLLERS that is mounted,
    from the text of /proc/self/mountinfo and /proc/self/cgroup."""
    own: dict[str, str] = {}
    for line in self_cgroup.splitlines():
        _, _, rest = line.partition(":")
        names, _, path = rest.partition(":")
        for name in names.split(","):
            if name in CONTROLLERS:
                own[name] = path.strip()
    found: dict[str, Path] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if len(fields) < sep + 4 or fields[sep + 1] != "cgroup" or len(fields) < 5:
            continue
        options = fields[sep + 3].split(",")
        for name in CONTROLLERS:
            if name in options and name in own and name not in found:
                root, path = fields[3], own[name]
                if path == root or path.startswith(root.rstrip("/") + "/"):
                    found[name] = Path(fields[4]) / path[len(root):].lstrip("/")
    return found


@dataclass(frozen=True)
class LimitGroups:
    """The cgroups a part's limits live in, by controller: the part's own v2 cgroup for all three,
    or one directory per v1 hierarchy. Its processes join each (confine_exec.py --cgroup)."""

    dirs: tuple[tuple[str, Path], ...]
    version: int

    def joins(self) -> list[Path]:
        """The directories a process must join, besides the tracking cgroup (v2: none)."""
        return [] if self.version == 2 else list(dict.fromkeys(path for _, path in self.dirs))

    def path(self, controller: str) -> Path | None:
        return next((path for name, path in self.dirs if name == controller), None)

    def apply(self, memory: int | None, pids: int | None, cpus: float | None, cpu_weight: int | None = None
              ) -> None:
        """Write the limits (raises OSError when a controller refuses)."""
        mem, pid, cpu = self.path("memory"), self.path("pids"), self.path("cpu")
        if mem is not None and memory is not None:
            if self.version == 2:
                _write(mem / "memory.max", str(memory))
                # The whole part goes when the kernel must kill in it: a rank left without a peer
                # would only hang in its next collective.
                with contextlib.suppress(OSError):
                    _write(mem / "memory.oom.group", "1")
                with contextlib.suppress(OSError):
                    _write(mem / "memory.swap.max", "0")
            else:
                _write(mem / "memory.limit_in_bytes", str(memory))
                with contextlib.suppress(OSError):
                    _write(mem / "memory.memsw.limit_in_bytes", str(memory))
        if pid is not None and pids is not None:
            _write(pid / "pids.max", str(pids))
        if cpu is not None and cpu_weight is not None:
            if self.version == 2:
                _write(cpu / "cpu.weight", str(cpu_weight))
            else:
                _write(cpu / "cpu.shares", str(cpu_weight * 1024 // 100))
        if cpu is not None and cpus is not None:
            quota = max(1000, int(cpus * CPU_PERIOD_US))
            if self.version == 2:
                _write(cpu / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(cpu / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))

    def counters(self) -> tuple[int, int]:
        """(processes the kernel killed for memory, forks refused at pids.max) so far."""
        oom = pids = 0
        mem, pid = self.path("memory"), self.path("pids")
        with contextlib.suppress(OSError):
            if mem is not None:
                name = "memory.events" if self.version == 2 else "memory.oom_control"
                oom = _counter(_read(mem / name), "oom_kill")
        with contextlib.suppress(OSError):
            if pid is not None:
                pids = _counter(_read(pid / "pids.events"), "max")
        return oom, pids

    def remove(self) -> None:
        """Remove the v1 directories (the v2 one is the tracking cgroup's to remove)."""
        for path in reversed(self.joins()):
            with contextlib.suppress(OSError):
                path.rmdir()

    def to_state(self) -> dict[str, object]:
        return {"version": self.version, "dirs": [[name, str(path)] for name, path in self.dirs]}

    @classmethod
    def from_state(cls, state: object) -> LimitGroups | None:
        if not isinstance(state, dict) or state.get("version") not in (1, 2) or not isinstance(state.get("dirs"), list):
            return None
        dirs = tuple((d[0], Path(d[1])) for d in state["dirs"]
                     if isinstance(d, list) and len(d) == 2 and d[0] in CONTROLLERS and isinstance(d[1], str))
        return cls(dirs, state["version"])


def _move_to_leaf(own: Path) -> str | None:
    """Move every process of ``own`` into ``own/AGENT_LEAF``; None when done, else why not."""
    leaf = own / AGENT_LEAF
    try:
        leaf.mkdir(exist_ok=True)
        for _ in range(3):  # a process may fork meanwhile
            pids = _read(own / "cgroup.procs").split()
            if not pids:
                return None
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    _write(leaf / "cgroup.procs", pid)
    except OSError as exc:
        return f"cannot move its processes to {leaf}: {exc}"
    return None if not _read(own / "cgroup.procs").split() else f"{own} still holds processes"


class LimitTree:
    """Where this agent can set limits: the v2 tree (controllers enabled down to it) or v1 bases."""

    def __init__(self, version: int, bases: dict[str, Path]) -> None:
        self.version = version
        self.bases = bases

    @classmethod
    def detect(cls, tracking: CgroupTree | None) -> tuple[LimitTree | None, str]:
        """The controllers this agent can use, with why (for the agent's log)."""
        if os.geteuid() != 0:
            return None, f"the agent is not root (uid {os.geteuid()}): it cannot set cgroup limits"
        why_v2 = "no cgroup v2 is writable" if tracking is None else cls._enable_v2(tracking)
        if tracking is not None and why_v2 is None:
            return cls(2, dict.fromkeys(CONTROLLERS, tracking.base)), (
                f"memory, pids and cpu limits in cgroup v2 at {tracking.base}")
        try:
            own = cgroup1_dirs(_read(Path("/proc/self/mountinfo")), _read(Path("/proc/self/cgroup")))
        except OSError as exc:
            return None, f"{why_v2}; cannot read /proc: {exc}"
        bases: dict[str, Path] = {}
        for name, directory in own.items():
            probe = directory / PARENT / f".probe-{os.getpid()}"
            try:
                probe.mkdir(parents=True, exist_ok=True)
                probe.rmdir()
            except OSError:
                continue
            bases[name] = directory / PARENT
        if "memory" in bases and "pids" in bases:
            return cls(1, bases), (f"{', '.join(sorted(bases))} limits in cgroup v1 hierarchies "
                                   f"({why_v2})")
        return None, f"no resource limits: {why_v2}, and no writable cgroup v1 memory and pids hierarchies"

    @staticmethod
    def _enable_v2(tracking: CgroupTree) -> str | None:
        """Enable CONTROLLERS from the agent's cgroup down to the tree's base; None when done."""
        own = tracking.base.parent
        try:
            offered = _read(own / "cgroup.controllers").split()
        except OSError as exc:
            return f"cannot read {own}/cgroup.controllers: {exc}"
        missing = [c for c in CONTROLLERS if c not in offered]
        if missing:
            return f"cgroup v2 at {own} offers no {', '.join(missing)} controller (they may be in cgroup v1)"
        wanted = " ".join(f"+{c}" for c in CONTROLLERS)
        for directory in (own, tracking.base):
            try:
                _write(directory / "cgroup.subtree_control", wanted)
            except OSError as exc:
                if directory != own or exc.errno != errno.EBUSY:
                    return f"cannot enable {wanted} in {directory}: {exc}"
                # A non-root cgroup that holds processes cannot delegate domain controllers (the
                # "no internal processes" rule): its processes (the agent's own, in a unit with
                # systemd's Delegate=yes) move to a leaf beside the attempts' tree, then it can.
                why = _move_to_leaf(own)
                if why is not None:
                    return f"cannot enable {wanted} in {own}: {exc}; {why}"
                try:
                    _write(own / "cgroup.subtree_control", wanted)
                except OSError as again:
                    return f"cannot enable {wanted} in {own} even with its processes in {AGENT_LEAF}/: {again}"
        return None

    def for_part(self, tracking: AttemptCgroup | None, node_id: str, attempt_id: str, node_rank: int) -> LimitGroups:
        """The part's limit cgroups, made (raises OSError). v2: ``tracking`` itself, made here."""
        name = f"{attempt_id}.{node_rank}"
        if self.version == 2:
            if tracking is None:
                raise OSError("no tracking cgroup to set limits on")
            node_dir = tracking.path.parent
            node_dir.mkdir(parents=True, exist_ok=True)
            _write(node_dir / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            tracking.create()
            return LimitGroups(tuple((c, tracking.path) for c in CONTROLLERS), 2)
        dirs = []
        for controller, base in self.bases.items():
            path = base / f"node-{node_id}" / name
            path.mkdir(parents=True, exist_ok=True)
            dirs.append((controller, path))
        return LimitGroups(tuple(dirs), 1)
