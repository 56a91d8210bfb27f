"""A warm standby: an interpreter with torch imported that becomes one rank's worker, once.

    python -m node_agent.ranks.standby --socket PATH --parent PID [--preload MOD]... [--uids A-B]
                                       [--cgroup-base DIR] [--idle]
    python -m node_agent.ranks.standby --zygote --parent PID [--preload MOD]... [--uids A-B]
                                       [--cgroup-base DIR] [--idle]

``--idle``: import and wait at SCHED_IDLE (one started during a recovery must not take CPU from the
ranks starting then); back to normal when claimed.

``--zygote``: import once, then fork a standby for each socket path the agent writes on stdin (one
line each), answering each with the standby's pid on stdout (after ``ready`` once the imports are
done). A standby forked so serves as a ``--socket`` start would, without its seconds of imports: the
agent's pool (node_agent/ranks/standby_pool.py) replaces a claimed standby at no CPU cost. The
zygote serves nobody itself, never runs a job's code and reads only the agent's pipe. What a fork
cannot give (docs/security.md): the standbys of one zygote, and so the warm workers of every job on
the node, share its address-space layout, stack canary and string-hash secret.

The agent keeps a few of these (node_agent/ranks/standby_pool.py, ``--standbys``) so that a new
attempt's rank skips the cold start (interpreter, torch import). The rank shim connects to one,
hands it the rank's command, env, cwd and stdout/stderr (node_agent/ranks/standby_wire.py); the standby
takes on the shim's confinement, forks the worker, reports its pid, waits for it and reports its
exact exit status. The shim still writes the rank file (pid, exit code) as for a cold start.

Why it is safe (docs/security.md):
- No state: it is started fresh (exec'd, never forked from the agent), or forked from a zygote
  that was, with the platform's environment and no Trainyard variable; it imports only the
  preloaded modules and never initialises CUDA (no GPU memory while idle). It serves one rank and
  then it is gone; the agent starts another. A forked one holds none of the zygote's pipes (its
  stdin and stdout are /dev/null before anything else), and Python's ``random`` (and numpy's, if
  loaded) is reseeded in it, as a fresh interpreter's would be.
- Exactly the shim's confinement: before the fork it joins the cgroup the shim is in (while still
  root), enters the shim's mount namespace, drops to the shim's uid and gid (no supplementary
  group), forbids new privileges and sets umask 077, as confine_exec.py does for torchrun.
  Only a peer that is a Trainyard worker is served: its uid is in the worker pool (or the agent's
  own without a pool) and, with cgroups, it is in a cgroup under the agent's tree.
- The agent never kills a standby that has taken on an attempt (its cgroup or uid changed): from
  then on it is one of the attempt's processes.
- Forking a process with threads is unsafe; the standby checks it has one thread after its
  imports, and refuses to serve otherwise. CUDA does not survive a fork either: it refuses to serve
  if its imports loaded the CUDA driver (bench/gpu_fast_path_check.py checks a worker forked from
  one initialises its GPU).

The worker is the forked child: it sets the rank's environment, argv, sys.path, cwd and stdio, and
runs the entrypoint as ``python -m`` or ``python FILE`` would, then the interpreter exits as a cold
one does (atexit, threads joined, the exit status of SystemExit or 1 for an uncaught exception).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib
import os
import select
import signal
import socket
import struct
import sys
import types
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn

from node_agent.confinement.cgroups import PARENT, cgroup1_dirs, cgroup2_dir
from node_agent.ranks import standby_wire as wire

_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_CLONE_NEWNS = 0x00020000
EXIT_BAD_USAGE, EXIT_THREADED, EXIT_CUDA = 2, 3, 4
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
"""What the rank shim forwards to its worker (rank_shim.FORWARDED_SIGNALS); a claimed standby
ignores them, its worker decides."""
_HERE = __file__
"""This file, whose frames a worker's traceback leaves out (``_cold_frames``)."""
HANDOVER_TIMEOUT_S = 10.0
"""How long a shim may take to send its request once connected."""


@dataclass(frozen=True)
class Policy:
    uids: tuple[int, int] | None
    """The worker pool (first, last); None: only the standby's own uid may claim it."""
    cgroup_base: str | None
    """With cgroups, a claimant must be in a cgroup below this directory, which the standby joins."""


@dataclass(frozen=True)
class Rank:
    """What a claimed standby runs, in the forked worker."""

    kind: str
    entrypoint: str
    args: list[str]
    env: dict[str, str]
    cwd: str


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _cuda_loaded() -> bool:
    """True when the CUDA driver library is mapped in this process (something called into CUDA)."""
    try:
        with open("/proc/self/maps") as f:
            return any("/libcuda.so" in line for line in f)
    except OSError:
        return False


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


def _cgroup_of(pid: int) -> str | None:
    """The cgroup v2 path of ``pid`` relative to the hierarchy's root."""
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return None


def _limits_of(pid: int) -> tuple[list[str], int | None]:
    """The claimant's resource-limit cgroups in cgroup v1 hierarchies (those below this machine's
    Trainyard trees: a hybrid machine's memory, pids and cpu limits) and its oom_score_adj, which a
    rank started in this standby takes on like its cold-started peers (issue 23, finding 6)."""
    try:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
        with open("/proc/self/cgroup") as f:
            own = cgroup1_dirs(mountinfo, f.read())
        with open(f"/proc/{pid}/cgroup") as f:
            theirs = cgroup1_dirs(mountinfo, f.read())
        with open(f"/proc/{pid}/oom_score_adj") as f:
            adj: int | None = int(f.read())
    except (OSError, ValueError):
        return [], None
    joins = [str(path) for name, path in theirs.items()
             if name in own and str(path).startswith(os.path.join(str(own[name]), PARENT) + "/")]
    return joins, adj


def _check(request: dict[str, Any], startup: dict[str, str]) -> tuple[Rank | None, str | None]:
    kind, entrypoint, args = request.get("kind"), request.get("entrypoint"), request.get("args")
    env, cwd = request.get("env"), request.get("cwd")
    if kind not in ("module", "file") or not isinstance(entrypoint, str) or not entrypoint:
        return None, "bad entrypoint"
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return None, "bad args"
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None, "bad env"
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        return None, "bad cwd"
    if request.get("python") != sys.executable or request.get("prefix") != sys.prefix:
        return None, f"another interpreter ({request.get('prefix')}) than the standby's ({sys.prefix})"
    wanted = wire.startup_env(env)
    if wanted != startup:
        differ = sorted(set(wanted.items()) ^ set(startup.items()))
        return None, f"startup variables differ from the standby's: {sorted({k for k, _ in differ})}"
    return Rank(kind, entrypoint, list(args), dict(env), cwd), None


class Standby:
    def __init__(self, path: str, policy: Policy, startup: dict[str, str]) -> None:
        self.path = path
        self.policy = policy
        self.startup = startup
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stdio: list[int] = []
        """The worker's stdout and stderr, received with the claim."""
        self.handlers: dict[int, Any] = {}
        """The stop signals' handlers before the claim ignored them (the worker gets them back)."""

    def listen(self) -> None:
        """Bind under a temporary name and rename into place: a shim only ever finds a warm one."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        self.listener.bind(tmp)
        os.chmod(tmp, 0o666)  # worker uids connect; the claim checks who they are (Policy)
        self.listener.listen(16)
        os.replace(tmp, self.path)

    def serve(self) -> tuple[socket.socket, Rank]:
        """Wait for a claim that passes the checks; declined ones leave this standby as it was."""
        while True:
            conn, _ = self.listener.accept()
            try:
                claimed = self._handle(conn)
            except (OSError, ValueError, ConnectionError):
                claimed = None
            if claimed is not None:
                return conn, claimed
            conn.close()

    def _decline(self, conn: socket.socket, fds: list[int], why: str) -> None:
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            wire.send(conn, {"declined": why})

    def _handle(self, conn: socket.socket) -> Rank | None:
        conn.settimeout(HANDOVER_TIMEOUT_S)
        pid, uid, gid = _peer(conn)
        request, fds = wire.receive(conn, with_fds=True)
        rank, why = _check(request, self.startup)
        if rank is None or why is not None:
            self._decline(conn, fds, why or "bad request")
            return None
        if self.policy.uids is not None:
            first, last = self.policy.uids
            if not first <= uid <= last:
                self._decline(conn, fds, f"uid {uid} is not a worker uid")
                return None
        elif uid != os.getuid():
            self._decline(conn, fds, f"uid {uid} may not use this agent's standbys")
            return None
        pidfd = os.pidfd_open(pid)
        try:
            cgroup_dir = self._cgroup_dir(pid)
            if self.policy.cgroup_base is not None and cgroup_dir is None:
                self._decline(conn, fds, "the claimant is not in one of the agent's attempt cgroups")
                return None
            limits = _limits_of(pid)
            mnt = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            # What was read from /proc is the claimant's only if the claimant still lives now.
            if select.select([pidfd], [], [], 0)[0]:
                os.close(mnt)
                self._decline(conn, fds, "the claimant is gone")
                return None
        finally:
            os.close(pidfd)
        # The claim: from this rename on nobody else may connect, and the agent leaves this process
        # to the rank. When the agent unlinked the socket first, it is taking the standby back.
        try:
            os.rename(self.path, wire.claimed_path(self.path))
        except FileNotFoundError:
            os.close(mnt)
            self._decline(conn, fds, "the agent is stopping this standby")
            os._exit(0)
        self.listener.close()
        # The rank's from here on: it no longer dies with its zygote or the agent (a handover in
        # progress must not be cut short by either going; _confine says so again).
        _libc().prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
        _idle_priority(False)
        # From the cgroup join on, a stop aimed at the attempt reaches this process too: it must
        # outlive its worker's handling of it. The worker gets back what a cold interpreter has.
        self.handlers = {sig: signal.signal(sig, signal.SIG_IGN) for sig in STOP_SIGNALS}
        self._confine(conn, cgroup_dir, mnt, uid, gid, limits)
        self.stdio = fds
        return rank

    def _cgroup_dir(self, pid: int) -> str | None:
        """The claimant's cgroup directory when it is below the agent's tree, else None."""
        if self.policy.cgroup_base is None:
            return None
        relative = _cgroup_of(pid)
        with open("/proc/self/mountinfo") as f:
            mount = cgroup2_dir(f.read(), "0::/")
        if relative is None or mount is None:
            return None
        found = os.path.normpath(os.path.join(str(mount), relative.lstrip("/")))
        return found if found.startswith(os.path.normpath(self.policy.cgroup_base) + "/") else None

    def _confine(self, conn: socket.socket, cgroup_dir: str | None, mnt: int, uid: int, gid: int,
                 limits: tuple[list[str], int | None] = ([], None)) -> None:
        """Take on the claimant's confinement, in confine_exec.py's order; any failure ends the
        standby (the shim, told why, starts its rank cold)."""
        try:
            # No descriptor of the agent's (its log, its terminal) may stay with a worker's process.
            null = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):
                os.dup2(null, target)
            os.close(null)
            if cgroup_dir is not None:
                with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
                    procs.write(str(os.getpid()))
            joins, oom_score_adj = limits
            for directory in joins:  # the part's limits in cgroup v1 hierarchies (node_agent/confinement/cgroups.py)
                with open(os.path.join(directory, "cgroup.procs"), "w") as procs:
                    procs.write(str(os.getpid()))
            if oom_score_adj is not None:  # not the agent's -1000, inherited at the standby's start
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write(str(oom_score_adj))
            libc = _libc()
            theirs = os.readlink(f"/proc/self/fd/{mnt}")
            if os.readlink("/proc/self/ns/mnt") != theirs and libc.setns(mnt, _CLONE_NEWNS) != 0:
                raise OSError(ctypes.get_errno(), "setns(mount namespace)")
            os.close(mnt)
            if (os.getuid(), os.getgid()) != (uid, gid):
                os.setgroups([])
                os.setresgid(gid, gid, gid)
                os.setresuid(uid, uid, uid)
            if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
                raise OSError("the uid did not change")
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
            # The worker's own process now, like one exec'd as this uid: it survives the agent
            # (attempts outlive agent restarts), and its owner may inspect it (py-spy, /proc/self/fd).
            libc.prctl(_PR_SET_PDEATHSIG, 0, 0, 0, 0)
            libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)
            os.umask(0o077)
        except OSError as exc:
            # Said to the shim (it logs it and starts cold rather than trying the next standby).
            self._decline(conn, [], f"cannot take on the rank's confinement: {exc}")
            os._exit(1)


def _become_worker(rank: Rank, stdio: list[int], standby_pid: int) -> None:
    """In the forked child: turn this interpreter into the rank's, as a cold start would set it up."""
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the standby reports for it; never outlive it
    if os.getppid() != standby_pid:
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for target, fd in zip((1, 2), stdio, strict=False):
        os.dup2(fd, target)
    for fd in stdio:
        os.close(fd)
    os.chdir(rank.cwd)
    os.environ.clear()
    os.environ.update(rank.env)
    # sys.path as `python -m`/`python FILE` builds it: the script's directory (or cwd), then
    # PYTHONPATH, then the installation's (the standby's own first entry and PYTHONPATH dropped).
    installed = [p for p in sys.path[1:] if p not in _STANDBY_PYTHONPATH]
    first = rank.cwd if rank.kind == "module" else os.path.dirname(os.path.realpath(rank.entrypoint))
    extra = [os.path.abspath(p) for p in rank.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *installed]
    sys.argv[:] = [rank.entrypoint, *rank.args]
    importlib.invalidate_caches()
    _apply_threads(rank.env)
    # Caches of the environment made while importing: the rank's TMPDIR, not the standby's.
    cached = sys.modules.get("tempfile")
    if cached is not None:
        cached.__dict__["tempdir"] = None


def _apply_threads(env: dict[str, str]) -> None:
    """torch's intra-op threads as a cold start with ``env`` would have them (standby_wire,
    APPLIED_AT_HANDOVER): the rank's OMP_NUM_THREADS (at most the machine's CPUs, as torch 2.13's
    import gives it: tests/node_agent/test_standby.py compares), else OpenMP's default (the CPUs this
    process may run on, now that it is in the rank's cgroup)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    value = env.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        threads = min(int(value), os.cpu_count() or int(value))  # a cold import caps it at the machine's CPUs
    else:
        threads = len(os.sched_getaffinity(0))
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _idle_priority(idle: bool) -> None:
    """``--idle``: the standby imports and waits at SCHED_IDLE, so that one started in place of a
    claimed one (during a recovery) takes no CPU from the ranks starting then. A claimed one is back
    to normal before it forks (allowed to any process whose nice value permits it, root or not)."""
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, policy, os.sched_param(0))


_STANDBY_PYTHONPATH: list[str] = []


def _wait_and_report(conn: socket.socket, child: int) -> NoReturn:
    """The standby's last job: tell the shim the worker's exit status; if the shim goes, so does the worker."""
    pidfd = os.pidfd_open(child)
    conn.settimeout(None)
    while True:
        ready, _, _ = select.select([pidfd, conn.fileno()], [], [])
        if pidfd in ready:
            break
        if conn.fileno() in ready and not conn.recv(1):
            os.kill(child, signal.SIGKILL)  # the shim is gone: nobody would record this worker
            break
    _, status = os.waitpid(child, 0)
    code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with contextlib.suppress(OSError):
        wire.send(conn, {"returncode": code})
    os._exit(0)


@dataclass(frozen=True)
class Options:
    path: str | None
    """--socket (None with --zygote: each forked standby gets its own from the agent)."""
    parent: int
    preload: list[str]
    policy: Policy
    idle: bool
    zygote: bool


def _parse(argv: list[str]) -> Options:
    path, parent, preload, uids, cgroup_base = None, None, [], None, None
    rest = list(argv)
    flags = {flag: flag in rest for flag in ("--idle", "--zygote")}
    for flag, given in flags.items():
        if given:
            rest.remove(flag)
    while rest:
        flag = rest.pop(0)
        if not rest:
            raise SystemExit(f"standby: {flag} needs a value")
        value = rest.pop(0)
        if flag == "--socket":
            path = value
        elif flag == "--parent":
            parent = int(value)
        elif flag == "--preload":
            preload.append(value)
        elif flag == "--uids":
            first, _, last = value.partition("-")
            uids = (int(first), int(last or first))
        elif flag == "--cgroup-base":
            cgroup_base = value
        else:
            raise SystemExit(f"standby: unknown option {flag}")
    zygote = flags["--zygote"]
    if parent is None or (path is None) != zygote:
        raise SystemExit("usage: python -m node_agent.ranks.standby (--socket PATH | --zygote) --parent PID "
                         "[--preload MOD]...")
    return Options(path, parent, preload, Policy(uids=uids, cgroup_base=cgroup_base), flags["--idle"], zygote)


def main(argv: list[str] | None = None) -> None:
    options = _parse(sys.argv[1:] if argv is None else argv)
    startup = wire.startup_env(dict(os.environ))
    _STANDBY_PYTHONPATH[:] = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if sys.path and sys.path[0] not in _STANDBY_PYTHONPATH:
        _STANDBY_PYTHONPATH.append(sys.path[0])  # the standby's own script directory (its cwd for -m)
    libc = _libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # unclaimed, it is the agent's: it goes with it
    if os.getppid() != options.parent:
        os._exit(1)
    if options.idle:
        _idle_priority(True)
    for name in options.preload:
        importlib.import_module(name)  # never torch.cuda: no CUDA context, no GPU memory while idle
    if _threads() != 1:
        print(f"standby: {_threads()} threads after importing {options.preload}; forking it would be unsafe",
              file=sys.stderr)
        sys.exit(EXIT_THREADED)
    if _cuda_loaded():
        # CUDA does not survive a fork: a preload that initialised it (torch.cuda.is_available()
        # at import) would leave every worker forked from here without a usable GPU.
        print(f"standby: the CUDA driver was loaded while importing {options.preload}; a forked worker could "
              "not use it", file=sys.stderr)
        sys.exit(EXIT_CUDA)
    if options.zygote:
        path = _zygote()
        if path is None:
            return  # the agent closed the pipe: the zygote ends (its unclaimed standbys with it)
    else:
        assert options.path is not None
        path = options.path
    _serve(path, options.policy, startup)


ZYGOTE_READY = b"ready"
"""The zygote's first line on stdout: its imports are done, it forks on request."""


def _zygote() -> str | None:
    """Fork a standby for each socket path read from stdin, answering its pid on stdout; return in
    the forked child (its socket path), or None in the zygote when the agent closes the pipe. The
    zygote stays single-threaded (forking is safe) and reaps the standbys it forked."""
    me = os.getpid()
    os.write(1, ZYGOTE_READY + b"\n")
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 1.0)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            _reap()
            return None
        pending += chunk
        while b"\n" in pending:
            line, _, pending = pending.partition(b"\n")
            path = os.fsdecode(line)
            if not path.startswith("/"):
                os.write(1, b"0\n")  # not a socket path: nothing forked
                continue
            child = os.fork()
            if child == 0:
                _forked(me)
                return path
            os.write(1, f"{child}\n".encode())


def _reap() -> None:
    """Collect the zygote's standbys that ended (unclaimed ones killed, claimed ones done)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _forked(zygote: int) -> None:
    """In a standby just forked from the zygote: become what a fresh ``--socket`` start is."""
    null = os.open(os.devnull, os.O_RDWR)
    for target in (0, 1):  # the agent's pipes to the zygote stay the zygote's
        os.dup2(null, target)
    os.close(null)
    os.setsid()  # a session of its own, as the pool starts an exec'd standby
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # unclaimed, it goes with the zygote
    if os.getppid() != zygote:
        os._exit(1)
    numpy_random = sys.modules.get("numpy.random")  # `random` reseeds itself after a fork
    if numpy_random is not None:
        numpy_random.seed()


def _serve(path: str, policy: Policy, startup: dict[str, str]) -> None:
    """Listen on ``path``, wait for the rank that claims this standby, fork its worker and report
    the worker's exit; returns only in the worker, to run the entrypoint."""
    standby = Standby(path, policy, startup)
    standby.listen()
    conn, rank = standby.serve()
    sys.stdout.flush()
    sys.stderr.flush()
    me = os.getpid()
    # A stop reaches every process of the attempt at once (the agent signals its cgroup or uid): the
    # standby must outlive its worker's handling of it, or the worker's death signal would cut it
    # short. Ignored since the claim (Standby._handle), so no stop can land before the fork.
    handlers = standby.handlers
    child = os.fork()
    if child == 0:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        conn.close()
        _become_worker(rank, standby.stdio, me)
        del standby, conn
        _run(rank)
        return
    for fd in standby.stdio:
        os.close(fd)
    try:
        wire.send(conn, {"pid": child})
    except OSError:
        os.kill(child, signal.SIGKILL)
    _wait_and_report(conn, child)


def _run(rank: Rank) -> None:
    """Run the entrypoint as the interpreter's main program; what it raises ends the interpreter."""
    import runpy

    # Python's own startup made these for the standby; the worker's stdio are new files.
    sys.stdout = open(1, "w", buffering=1 if sys.stdout.line_buffering else -1, closefd=False,  # noqa: SIM115
                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stderr = open(2, "w", buffering=1, closefd=False, encoding=sys.stderr.encoding,  # noqa: SIM115
                      errors=sys.stderr.errors)
    if os.environ.get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    # A cold interpreter's __main__ is empty; `python -m` runs the module in it. (This one is the
    # standby's own module, whose names the worker must not see.)
    fresh = types.ModuleType("__main__")
    fresh.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = fresh
    try:
        if rank.kind == "module":
            runpy._run_module_as_main(rank.entrypoint, alter_argv=True)  # type: ignore[attr-defined]  # `python -m`'s
        else:
            runpy.run_path(rank.entrypoint, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise  # the interpreter ends as a cold one would (a KeyboardInterrupt by SIGINT)
    except BaseException as exc:
        # The traceback a cold start prints: the worker's own frames, not the standby's (the rank
        # shim classifies the failure from it: a start error fails the job at once).
        tb = _cold_frames(exc.__traceback__, rank)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # it prints the exception's own traceback
        sys.exit(1)


def _cold_frames(tb: TracebackType | None, rank: Rank) -> TracebackType | None:
    """``tb`` without the frames a cold ``python -m MOD`` or ``python FILE`` would not have."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name != _HERE and (rank.kind == "module" or name == rank.entrypoint):
            break
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    main()
