"""Each attempt part runs as its own unprivileged user, in its own cgroup (docs/security.md).

The agent holds a pool of uids (``--worker-uids 20000-20063``). Every attempt part gets one uid
(its gid has the same number, with no supplementary group) for all its processes, torchrun
included, and keeps it until the last of those processes is gone: a uid is leased under a lock
file (``<run dir>/worker-uids/<uid>.lock``, held by the agent for the attempt's life) and only
when no process of that uid is alive, so several agents on one machine may share a pool. The uid
owns only the attempt's worker directory (0700): its cwd, HOME, TMPDIR, rank status and logs. The
agent's own files (state, sockets, its code) are root's and not writable, or not readable, by it.
Processes signal and ptrace only their own uid, and /proc/<pid>/environ of another uid (the agent's
join token, another attempt's fencing token) is unreadable.

Processes are counted by cgroup where cgroup v2 is writable (node_agent/confinement/cgroups.py), else by uid:
every process of the attempt's uid is the attempt's. An agent that is not root cannot switch users:
without a pool it runs workers as itself and says so loudly at start; with a pool it refuses to start.

torchrun is started through node_agent/confinement/confine_exec.py, which joins the cgroup and drops the
privileges in the new process before torchrun runs. The Python installation, the code and the venv
must be readable by the worker uids; one below a private directory (pyenv in a 0700 /root) is
exposed, read-only and alone, in a mount namespace of the attempt's own (confine_exec.py, --expose).
At start the agent proves all this by running the rank shim's imports as a pool uid (probe).
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_agent.confinement.cgroups import AttemptCgroup, CgroupTree, LimitGroups, LimitTree
from node_agent.confinement.confine_exec import blocked_ancestor
from node_agent.confinement.limits import LimitOptions, PartLimits, format_size
from node_agent.confinement.part_limits import WORKER_OOM_SCORE_ADJ, PartLimiter, node_resources, protect_agent
from node_agent.confinement.processes import uids_alive
from node_agent.confinement.short_tmp import short_tmp

CONFINE_EXEC = str(Path(__file__).resolve().with_name("confine_exec.py"))
AGENT_PYTHON = sys.executable
"""The only interpreter ever started as root for a part: the agent's own (node_agent/confinement/interpreters.py)."""
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
PROBE = "import node_agent.ranks.shim, worker_runtime.agent_http"
"""What every worker imports first: the interpreter, the code and the venv's packages."""
WORKER_SUBDIRS = ("home", "tmp", "status", "logs")
SCRUBBED_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
"""Shared directories whose top-level entries a released uid owned are deleted: the next attempt
given that uid must not find the previous one's files."""
MAX_POOL = 65536


class IsolationError(RuntimeError):
    """The configured isolation cannot be provided on this machine."""


@dataclass(frozen=True)
class UidRange:
    first: int
    last: int

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.last < 2**32 - 1:
            raise ValueError(f"worker uids must be 1..4294967294 and first <= last, got {self}")
        if self.last - self.first + 1 > MAX_POOL:
            raise ValueError(f"a worker uid pool holds at most {MAX_POOL} uids")

    @classmethod
    def parse(cls, text: str) -> UidRange:
        """``20000-20063`` or a single ``20000``."""
        first, sep, last = text.strip().partition("-")
        try:
            return cls(int(first), int(last) if sep else int(first))
        except ValueError as exc:
            raise ValueError(f"worker uids must look like 20000-20063, got {text!r}: {exc}") from None

    def __iter__(self) -> Any:
        return iter(range(self.first, self.last + 1))

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def account_problem(uids: UidRange) -> str | None:
    """Why this pool must not be used: a uid (or gid) that an account or group other than a
    Trainyard one has would give attempts that account's files."""
    for uid in uids:
        for lookup, kind in ((pwd.getpwuid, "user"), (grp.getgrgid, "group")):
            try:
                name = lookup(uid)[0]
            except KeyError:
                continue
            if not name.startswith("trainyard"):
                return f"uid/gid {uid} of the worker pool belongs to the {kind} {name!r}; use numbers no account has"
    return None


class UidLease:
    """One uid held for one attempt part, by an exclusive lock on its file (released on close or
    when the agent exits)."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self.gid = uid
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class UidPool:
    def __init__(self, uids: UidRange, lock_dir: Path) -> None:
        self.uids = uids
        self.lock_dir = lock_dir
        lock_dir.mkdir(parents=True, exist_ok=True)
        lock_dir.chmod(0o700)

    def _lock(self, uid: int) -> UidLease | None:
        fd = os.open(self.lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return UidLease(uid, fd)

    def lease(self, alive: Any) -> UidLease | None:
        """The first free uid: not locked by any agent, and no live process has it (``alive()``
        gives the uids of live processes; it is asked under the lock). None when all are taken."""
        busy: set[int] = alive()
        for uid in self.uids:
            if uid in busy:
                continue
            lease = self._lock(uid)
            if lease is None:
                continue
            if uid in alive():  # it started between the first look and the lock
                lease.close()
                continue
            return lease
        return None

    def claim(self, uid: int) -> UidLease | None:
        """The lock of an adopted attempt's uid (its processes may live: they are its own); None
        when another agent holds it, which then owns that uid's processes and files."""
        return self._lock(uid) if self.uids.first <= uid <= self.uids.last else None


def scrub_uid_files(uid: int, roots: tuple[str, ...] = SCRUBBED_DIRS) -> list[str]:
    """Delete the top-level entries of ``roots`` that ``uid`` owns; returns what was removed."""
    removed = []
    for root in roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid != uid:
                    continue
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path)  # fd-based on Linux: no symlink inside is followed
                else:
                    os.unlink(entry.path)
                removed.append(entry.path)
            except OSError:
                continue
    return removed


def make_worker_dir(path: Path, uid: int | None, gid: int | None) -> None:
    """A fresh worker directory (0700, with WORKER_SUBDIRS), owned by the attempt's uid. Its parent
    must be the agent's: what an earlier attempt left under this name is removed first."""
    if path.exists() or path.is_symlink():
        remove_tree(path)
    path.mkdir(mode=0o700)
    for name in WORKER_SUBDIRS:
        (path / name).mkdir(mode=0o700)
    if uid is not None and gid is not None:
        for p in (path, *(path / name for name in WORKER_SUBDIRS)):
            os.lchown(p, uid, gid)
    make_short_tmp(path, uid, gid)  # TMPDIR (worker_tmp): see "A short TMPDIR per part" below


def remove_tree(path: Path) -> None:
    """Remove a directory a worker wrote in, never following a link it planted."""
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    shutil.rmtree(path, ignore_errors=True)


def private_dir(path: Path, mode: int = 0o700) -> Path:
    """Make ``path`` (and parents) and give it ``mode``: the agent's state is nobody else's."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def reachable_by_others(path: Path) -> str | None:
    """None when every directory from / down to ``path`` lets other users through (o+x); else the
    first that does not, which a worker uid could not get past to its own directory."""
    path = path.resolve()
    for directory in (*reversed(path.parents), path):
        try:
            if not directory.stat().st_mode & stat.S_IXOTH:
                return str(directory)
        except OSError:
            return str(directory)
    return None


@dataclass
class Confinement:
    """How one attempt part is confined; persisted in its state.json for a restarted agent."""

    uid: int | None = None
    gid: int | None = None
    cgroup: AttemptCgroup | None = None
    lease: UidLease | None = field(default=None, repr=False)
    expose: tuple[str, ...] = ()
    """Directories exposed to the workers in their own mount namespace (only at launch)."""
    limits: PartLimits | None = None
    """What the part may use (node_agent/confinement/limits.py); None: no limit."""
    limit_groups: LimitGroups | None = None
    """The cgroups the kernel enforces its memory, pids and cpu limits in."""
    shm_dir: Path | None = None
    """The tmpfs (of the part's /dev/shm size) that is /dev/shm in the part's mount namespace."""
    oom_score_adj: int | None = None
    """Set on its processes (the agent's own, -1000, must not be inherited)."""

    @property
    def isolated(self) -> bool:
        """Its processes run as a uid of their own."""
        return self.uid is not None

    @property
    def owns_uid(self) -> bool:
        """Its uid is leased to it (by this agent): every process of that uid is the attempt's."""
        return self.uid is not None and self.lease is not None and self.lease.held

    def to_state(self) -> dict[str, Any]:
        return {"uid": self.uid, "gid": self.gid, "cgroup": str(self.cgroup.path) if self.cgroup else None,
                "limits": self.limits.to_state() if self.limits else None,
                "limit_groups": self.limit_groups.to_state() if self.limit_groups else None,
                "shm_dir": str(self.shm_dir) if self.shm_dir else None}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Confinement:
        cgroup = state.get("cgroup")
        uid, gid = state.get("uid"), state.get("gid")
        return cls(
            uid=uid if isinstance(uid, int) else None,
            gid=gid if isinstance(gid, int) else None,
            cgroup=AttemptCgroup(Path(cgroup)) if isinstance(cgroup, str) and cgroup else None,
            limits=PartLimits.from_state(state.get("limits")),
            limit_groups=LimitGroups.from_state(state.get("limit_groups")),
            shm_dir=Path(shm) if isinstance(shm := state.get("shm_dir"), str) and shm else None,
        )

    def wrap(self, command: list[str], *, writable: tuple[str, ...] = ()) -> list[str]:
        """``command`` started through confine_exec.py, or as is when there is nothing to do.

        The wrapper runs as root until it switches to the uid, so it is always the agent's own
        interpreter (``-I -S``: nothing a job influenced is imported); the program it execs (a job's
        interpreter included) starts only after the switch (docs/security.md, "Interpreters and
        venvs"). ``writable``: directories below a private one that the uid must write (a venv it
        builds), exposed like ``expose`` but not read-only."""
        if self.cgroup is None and self.uid is None and self.oom_score_adj is None:
            return command
        prefix = [AGENT_PYTHON, "-I", "-S", CONFINE_EXEC]
        if self.cgroup is not None:
            prefix += ["--cgroup", str(self.cgroup.path)]
        for joined in self.limit_groups.joins() if self.limit_groups else ():
            prefix += ["--cgroup", str(joined)]
        if self.oom_score_adj is not None:
            prefix += ["--oom-score-adj", str(self.oom_score_adj)]
        if self.shm_dir is not None:
            prefix += ["--shm", str(self.shm_dir)]
        if self.uid is not None and self.gid is not None:
            prefix += ["--uid", str(self.uid), "--gid", str(self.gid)]
            for directory in self.expose:
                prefix += ["--expose", directory]
            for directory in writable:
                prefix += ["--expose-rw", directory]
        return [*prefix, "--", *command]


def writable_code() -> str | None:
    """Why a worker could change what the agent or later jobs run (the code, the interpreter's
    packages), or None: none of it may be writable by other users."""
    for top in (Path(PACKAGE_ROOT) / name for name in ("node_agent", "worker_runtime", "trainyard")):
        for path in (top, *top.rglob("*")):
            if path.lstat().st_mode & stat.S_IWOTH and not path.is_symlink():
                return f"{path} is writable by every user: a job could change what later jobs run"
    for directory in dict.fromkeys((Path(sys.prefix), Path(sys.base_prefix))):
        if directory.stat().st_mode & stat.S_IWOTH:
            return f"{directory} is writable by every user: a job could change what later jobs run"
    return None


def hidden_paths(paths: list[str]) -> tuple[str, ...]:
    """Those of ``paths`` that other users cannot reach because a directory above them is private
    (they can be exposed); one that is private itself cannot, and is left out."""
    found = []
    for path in dict.fromkeys(os.path.realpath(p) for p in paths):
        with contextlib.suppress(OSError):
            blocked = blocked_ancestor(path)
            if blocked is not None and blocked != path:
                found.append(path)
    return tuple(found)


def worker_paths(cwd: str) -> tuple[str, ...]:
    """What workers must read, hidden from other users: the Python installation, the venv, the code,
    the directory relative entrypoints resolve against."""
    return hidden_paths([sys.base_prefix, sys.prefix, PACKAGE_ROOT, cwd])


def probe(confinement: Confinement, python: str = sys.executable) -> str | None:
    """Run what a worker runs first, confined like one; None when it works, else why not."""
    # Without a uid of its own, only the cgroup is in question: no imports needed.
    check = [python, "-c", PROBE] if confinement.uid is not None else [python, "-I", "-S", "-c", "pass"]
    command = confinement.wrap(check)
    env = {"PYTHONPATH": PACKAGE_ROOT, "HOME": "/", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    try:
        done = subprocess.run(command, env=env, cwd="/", capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if done.returncode == 0:
        return None
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    return f"exit {done.returncode}: {lines[-1] if lines else 'no output'}"


class Isolation:
    """What this agent can do: a uid pool (root only) and cgroups (where writable)."""

    def __init__(self, *, pool: UidPool | None, cgroups: CgroupTree | None, expose: tuple[str, ...] = (),
                 limiter: PartLimiter | None = None) -> None:
        self.pool = pool
        self.cgroups = cgroups
        self.expose = expose
        self.limiter = limiter
        """Each part's resource limits (issue 23, finding 6); None: none (--no-part-limits)."""

    @classmethod
    def configure(
        cls, uids: UidRange | None, run_dir: Path, *, use_cgroups: bool, cwd: str,
        limits: LimitOptions | None = None, gpus: int = 0, work_dir: Path | None = None,
    ) -> tuple[Isolation, list[str]]:
        """The isolation the configuration asks for, proven by a probe; raises IsolationError when
        a pool is configured but cannot be used. Returns it with lines for the agent's log."""
        notes: list[str] = []
        pool = None
        if uids is not None:
            if os.geteuid() != 0:
                raise IsolationError(
                    f"--worker-uids {uids} needs an agent running as root (it runs as uid {os.geteuid()}); "
                    "run it as root, or without --worker-uids to run workers as the agent's own user"
                )
            problem = account_problem(uids) or writable_code()
            if problem is not None:
                raise IsolationError(problem)
            pool = UidPool(uids, private_dir(run_dir / "worker-uids"))
        cgroups = None
        if use_cgroups:
            cgroups, why = CgroupTree.detect()
            notes.append(f"tracking processes by {why}" if cgroups else f"no cgroup tracking ({why})")
        isolation = cls(pool=pool, cgroups=cgroups, expose=worker_paths(cwd) if pool is not None else (),
                        limiter=_limiter(limits, cgroups, run_dir, gpus, work_dir or run_dir, notes))
        if isolation.expose:
            notes.append(f"exposing {', '.join(isolation.expose)} to the workers (read-only, own mount namespace)")
        if pool is None and cgroups is None:
            return isolation, notes
        problem = isolation.probe()
        if problem is not None and cgroups is not None:
            notes.append(f"no cgroup tracking (a confined process could not start in one: {problem})")
            isolation.cgroups = None
            limiter = isolation.limiter
            if limiter is not None and limiter.tree is not None and limiter.tree.version == 2:
                # Its v2 limits live in the tracking cgroups just given up.
                notes.append("no memory, pids or cpu limits on parts (they were to be set in those cgroups)")
                limiter.tree = None
            problem = isolation.probe() if pool is not None else None
        if problem is not None:
            raise IsolationError(f"a worker uid cannot run this node's Python and code: {problem}")
        return isolation, notes

    def probe(self) -> str | None:
        """Start what a worker starts first, as a free pool uid in a fresh cgroup; None if it ran."""
        confinement = Confinement(expose=self.expose)
        if self.pool is not None:
            lease = self.pool.lease(uids_alive)
            if lease is None:
                return None  # every uid is some attempt's: they run, so the setup works
            confinement.uid, confinement.gid, confinement.lease = lease.uid, lease.gid, lease
        if self.cgroups is not None:
            confinement.cgroup = AttemptCgroup(self.cgroups.base / f".probe-{os.getpid()}")
            try:
                confinement.cgroup.create()
            except OSError as exc:
                self.release(confinement)
                return f"cannot make a cgroup: {exc}"
        try:
            return probe(confinement)
        finally:
            if confinement.cgroup is not None:
                confinement.cgroup.kill()
            self.release(confinement)

    @property
    def isolated(self) -> bool:
        return self.pool is not None

    def confine(self, node_id: str | None, attempt_id: str, node_rank: int, alive: Any, *, gpus: int = 0
                ) -> Confinement:
        """A uid, a cgroup and resource limits (for a part of ``gpus`` GPUs) for a new attempt part;
        raises IsolationError when the pool is exhausted or the limits cannot be set (the part then
        fails at once, saying so)."""
        confinement = Confinement()
        if self.pool is not None:
            lease = self.pool.lease(alive)
            if lease is None:
                raise IsolationError(
                    f"every worker uid ({self.pool.uids}) is in use by a live attempt; the node runs "
                    f"at most {len(self.pool.uids)} attempt parts at once"
                )
            confinement.uid, confinement.gid, confinement.lease = lease.uid, lease.gid, lease
            confinement.expose = self.expose
        if self.cgroups is not None and node_id is not None:
            part = self.cgroups.for_part(node_id, attempt_id, node_rank)
            try:
                part.create()
                confinement.cgroup = part
            except OSError:
                pass  # tracked by uid instead (or, unconfined, by markers)
        if self.limiter is not None:
            try:
                confinement.limits, confinement.limit_groups, confinement.shm_dir = self.limiter.apply(
                    confinement.cgroup, node_id or "local", attempt_id, node_rank, gpus,
                    confinement.uid, confinement.gid)
            except OSError as exc:
                self.release(confinement)
                raise IsolationError(f"cannot set the part's resource limits: {exc}") from exc
            confinement.oom_score_adj = WORKER_OOM_SCORE_ADJ
        return confinement

    def readopt(self, confinement: Confinement) -> None:
        """Take back the lock of an adopted attempt's uid. Without it (another agent holds it now)
        the uid is not this attempt's to track or scrub."""
        if self.pool is not None and confinement.uid is not None:
            confinement.lease = self.pool.claim(confinement.uid)

    def release(self, confinement: Confinement) -> list[str]:
        """After the last process of the part is gone: remove its cgroup, delete what its uid left
        in shared directories, give the uid back. Returns what was removed."""
        removed: list[str] = []
        if confinement.cgroup is not None:
            confinement.cgroup.remove()
        PartLimiter.release(confinement.limit_groups, confinement.shm_dir)
        lease = confinement.lease
        if lease is not None and lease.held:
            removed = scrub_uid_files(lease.uid)
            lease.close()
        return removed


def _limiter(options: LimitOptions | None, cgroups: CgroupTree | None, run_dir: Path, gpus: int, work_dir: Path,
             notes: list[str]) -> PartLimiter | None:
    """The agent's part limits (issue 23, finding 6), with a line for its log on what it can
    enforce here. None when turned off or not root (an agent that is not root can neither set
    cgroup limits nor mount a part's /dev/shm: said once, at start)."""
    if options is None or not options.enabled:
        if options is not None:
            notes.append("no resource limits on parts (--no-part-limits)")
        return None
    if os.geteuid() != 0:
        notes.append(f"no resource limits on parts: the agent is not root (uid {os.geteuid()})")
        return None
    protected = protect_agent()
    notes.append(protected or "the agent is the OOM killer's last choice (oom_score_adj -1000); workers get "
                 f"+{WORKER_OOM_SCORE_ADJ}")
    tree, why = LimitTree.detect(cgroups)
    notes.append(why if tree is not None else f"no memory, pids or cpu limits on parts ({why})")
    limiter = PartLimiter(tree, options, node_resources(work_dir, gpus), private_dir(run_dir / "shm"))
    sample = limiter.limits_for(1)
    notes.append(f"a part of 1 of the node's {gpus} GPUs may use {format_size(sample.memory or 0)} of memory, "
                 f"CPU weight {sample.cpu_weight}{f' capped at {sample.cpus} CPUs' if sample.cpus else ''}, "
                 f"{sample.pids} pids, {format_size(sample.shm or 0)} of /dev/shm and "
                 f"{format_size(sample.work_dir or 0)} of work dir")
    return limiter


# --- A short TMPDIR per part (issue 24) ---
# A unix socket's path holds at most 107 bytes. DataLoader workers (multiprocessing's resource
# sharer, torch's shared-memory manager) bind sockets under TMPDIR, and the worker directory's
# tmp/ under a realistic work dir (a project's .trainyard/dev/nodes/node-2/attempts/<uuid>/worker)
# leaves no room: they failed with "AF_UNIX path too long". So each part's TMPDIR is a short
# directory under /tmp, named by a hash of its worker directory (found again for the cleanup),
# inside a directory of the agent's own that nobody else may create entries in.



def make_short_tmp(worker: Path, uid: int | None, gid: int | None) -> Path | None:
    """Make ``short_tmp(worker)`` afresh (0700, the attempt uid's); None where it cannot be made
    safely (its parent is not this agent's own directory): the part keeps worker/tmp."""
    path = short_tmp(worker)
    parent = path.parent
    try:
        with contextlib.suppress(FileExistsError):
            parent.mkdir(mode=0o711)  # others pass through to their own directory, list nothing
        info = parent.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
            return None  # planted by someone else: nothing in it is ours to trust
        if path.exists() or path.is_symlink():
            remove_tree(path)
        path.mkdir(mode=0o700)
        if uid is not None and gid is not None:
            os.lchown(path, uid, gid)
    except OSError:
        return None
    return path


def worker_tmp(worker: Path) -> Path:
    """The TMPDIR a part's workers get: the short one where it was made, else worker/tmp."""
    path = short_tmp(worker)
    return path if path.is_dir() and not path.is_symlink() else worker / "tmp"


def remove_worker_dir(worker: Path) -> None:
    """Remove a part's worker directory and its short TMPDIR."""
    remove_tree(short_tmp(worker))
    remove_tree(worker)
