"""Resource limits of one attempt part (issue 23, finding 6): the policy, with no I/O.

A part that holds k of the node's n GPUs gets k/n of what the node can give its jobs: memory (the
node's memory less a reserve for the agent and the system), disk for its work directory, and CPU
time under contention (a CPU weight proportional to k: parts that all want every CPU get k/n each);
besides, a cap on its processes and threads (pids) and its own /dev/shm. CPU is weighted, not
capped, by default: a hard k/n quota would leave CPUs idle that the part's neighbours do not use,
and on a machine whose agents each count every CPU as theirs (a dev cluster) it would starve every
part; ``--part-cpus`` sets a hard cap besides. An operator overrides any
of them on the agent's command line (``--part-memory-limit`` etc., docs/operations.md). The kernel
enforces memory, pids and CPU through the part's cgroup (node_agent/confinement/cgroups.py), /dev/shm through a
tmpfs of the part's own size (node_agent/confinement/confine_exec.py); the work directory is measured by the
agent and the part stopped when it is over its cap (node_agent/part/attempt.py). A part that hits a
limit fails with the limit named in its reason (``limit_reason``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB = 2**30
MiB = 2**20
DEFAULT_RESERVE = 2 * GiB
"""Memory kept for the agent, the kernel and the node's other daemons (at most half the node's)."""
PIDS_PER_GPU = 4096
"""Processes and threads per GPU share (DataLoader workers, NCCL and OpenMP threads count too)."""
MIN_PIDS = 4096
CPU_WEIGHT_PER_GPU = 100
MAX_CPU_WEIGHT = 10_000
SHM_SHARE = 0.5
"""/dev/shm of a part: this share of its memory limit (tmpfs pages count against that limit too)."""
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str, *, zero: bool = False) -> int:
    """``48G``, ``512M``, ``1.5GiB``, ``1048576`` (bytes); powers of 1024; 0 only with ``zero``.
    Raises ValueError."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"a size looks like 48G, 512M or a number of bytes, got {text!r}")
    number, unit = float(match.group(1)), match.group(2).lower()
    size = int(number * 1024 ** " kmgt".index(unit or " "))
    if size < 0 or (size == 0 and not zero):
        raise ValueError(f"a size must be positive, got {text!r}")
    return size


def format_size(size: int) -> str:
    """Bytes as a person reads them: ``48 GiB``, ``512 MiB``, ``1.5 GiB``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if size >= scale:
            value = size / scale
            return f"{value:.0f} {unit}" if value == int(value) or value >= 100 else f"{value:.1f} {unit}"
    return f"{size} B"


@dataclass(frozen=True, kw_only=True)
class LimitOptions:
    """The operator's settings (agent options); None: derived from the node and the part's GPUs."""

    enabled: bool = True
    """False (``--no-part-limits``): no limit at all, as before issue 23."""
    memory: int | None = None
    """``--part-memory-limit``: bytes per part, whatever its GPUs."""
    reserve: int = DEFAULT_RESERVE
    """``--memory-reserve``: bytes of the node's memory no part's share includes."""
    pids: int | None = None
    """``--part-pids-max``: processes and threads per part."""
    cpus: float | None = None
    """``--part-cpus``: a hard cap, in CPUs of time per part (may be fractional); None: weighted only."""
    shm: int | None = None
    """``--part-shm-size``: bytes of the part's /dev/shm."""
    work_dir: int | None = None
    """``--part-work-dir-size``: bytes the part's work directory may hold."""

    def __post_init__(self) -> None:
        for name in ("memory", "pids", "cpus", "shm", "work_dir"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"the part's {name.replace('_', ' ')} limit must be positive, got {value}")
        if self.reserve < 0:
            raise ValueError(f"the memory reserve must not be negative, got {self.reserve}")


def limit_options(*, enabled: bool = True, memory: str | None = None, reserve: str | None = None,
                  pids: int | None = None, cpus: float | None = None, shm: str | None = None,
                  work_dir: str | None = None) -> LimitOptions:
    """LimitOptions from the agent's options as typed (both of its command lines use this); raises
    ValueError with what is wrong."""
    return LimitOptions(
        enabled=enabled,
        memory=parse_size(memory) if memory else None,
        reserve=parse_size(reserve, zero=True) if reserve else DEFAULT_RESERVE,
        pids=pids, cpus=cpus,
        shm=parse_size(shm) if shm else None,
        work_dir=parse_size(work_dir) if work_dir else None,
    )


@dataclass(frozen=True, kw_only=True)
class PartLimits:
    """What one part may use; None: not limited."""

    memory: int | None = None
    pids: int | None = None
    cpus: float | None = None
    """A hard cap in CPUs (CFS quota)."""
    cpu_weight: int | None = None
    """Its CPU weight (cgroup v2 cpu.weight, 100 per GPU; v1 cpu.shares scaled to 1024 per GPU)."""
    shm: int | None = None
    work_dir: int | None = None

    def to_state(self) -> dict[str, int | float | None]:
        return {"memory": self.memory, "pids": self.pids, "cpus": self.cpus, "cpu_weight": self.cpu_weight,
                "shm": self.shm, "work_dir": self.work_dir}

    @classmethod
    def from_state(cls, state: object) -> PartLimits | None:
        if not isinstance(state, dict):
            return None
        def number(key: str) -> int | None:
            value = state.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
        cpus = state.get("cpus")
        return cls(memory=number("memory"), pids=number("pids"), shm=number("shm"), work_dir=number("work_dir"),
                   cpu_weight=number("cpu_weight"),
                   cpus=float(cpus) if isinstance(cpus, (int, float)) and not isinstance(cpus, bool) and cpus > 0
                   else None)


@dataclass(frozen=True, kw_only=True)
class NodeResources:
    """What the node has, read once at the agent's start."""

    memory: int
    cpus: int
    gpus: int
    work_dir_space: int
    """Size of the file system holding the worker directories, in bytes."""


def part_limits(node: NodeResources, part_gpus: int, options: LimitOptions) -> PartLimits:
    """The limits of a part holding ``part_gpus`` of the node's GPUs."""
    if not options.enabled:
        return PartLimits()
    # A CPU-only node (virtual slots) or a spec naming no GPU: the slots are its share.
    share = min(1.0, max(1, part_gpus) / node.gpus) if node.gpus > 0 else 1.0
    reserve = min(options.reserve, node.memory // 2)
    memory = options.memory or max(256 * MiB, int((node.memory - reserve) * share))
    pids = options.pids or max(MIN_PIDS, PIDS_PER_GPU * max(1, part_gpus))
    weight = min(MAX_CPU_WEIGHT, CPU_WEIGHT_PER_GPU * max(1, part_gpus))
    shm = options.shm or max(64 * MiB, int(memory * SHM_SHARE))
    work_dir = options.work_dir or max(256 * MiB, int(node.work_dir_space * share))
    return PartLimits(memory=memory, pids=pids, cpus=options.cpus, cpu_weight=weight, shm=shm, work_dir=work_dir)


@dataclass(frozen=True, kw_only=True)
class LimitEvents:
    """What the kernel counted for a part's cgroup (memory.events, pids.events)."""

    oom_kills: int = 0
    pids_max_hits: int = 0


def limit_reason(limits: PartLimits, events: LimitEvents) -> str | None:
    """The failure reason a limit hit gives the part; None when no limit was hit."""
    if events.oom_kills > 0 and limits.memory is not None:
        killed = f"the kernel killed {events.oom_kills} process{'es' if events.oom_kills > 1 else ''}"
        return f"out of memory: cgroup limit {format_size(limits.memory)} ({killed} of the part)"
    if events.pids_max_hits > 0 and limits.pids is not None:
        return (f"process limit: pids.max {limits.pids} reached (a fork failed {events.pids_max_hits} times); "
                "the part was stopped")
    return None


def shm_reason(limits: PartLimits) -> str:
    return (f"shared memory limit: /dev/shm of the part is full at its {format_size(limits.shm or 0)} cap; "
            "the part was stopped")


def work_dir_reason(limits: PartLimits, used: int) -> str:
    return (f"disk limit: the part's work directory holds {format_size(used)}, over its "
            f"{format_size(limits.work_dir or 0)} cap; the part was stopped")
