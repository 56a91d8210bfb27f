"""Put this process in an attempt's cgroup, drop to the attempt's uid and gid, then exec torchrun.

    python -I -S confine_exec.py [--cgroup DIR]... [--uid N --gid N] [--expose[-rw] DIR]...
        [--oom-score-adj N] [--shm DIR] -- PROGRAM [ARGS...]

The agent starts every attempt's torchrun through this file (node_agent/confinement/isolation.py). The steps
run in the new process before the program exists, so nothing the program starts can be outside the
cgroup or keep the agent's privileges: join the cgroup (while still root, the only one allowed to
write its cgroup.procs), drop every supplementary group, set gid then uid (real, effective and
saved), forbid gaining privileges again (no_new_privs: a setuid binary stays unprivileged), and
make files private by default (umask 077). Any failure exits with 126 and one line on stderr,
which lands in the attempt's torchrun.stderr.log and its reported error.

``--expose DIR``: a directory the workers need (the Python installation, say) below a directory
other users cannot enter (a 0700 /root holding pyenv). In a mount namespace of the attempt's own,
the first such directory above it is covered by an empty tmpfs (0755) and DIR alone is bound back
into place, read-only: the workers can run that Python and see nothing else of /root. The host's
mounts are untouched (the namespace's mounts are private).

``--expose-rw DIR``: the same for a directory the uid must write (a venv it builds, node_agent/part/envs.py).

Standard library only, and run with ``-I -S`` by the agent's own interpreter, never a job's: it runs
as root until the switch, so it must not import or be anything a worker could have influenced.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import NoReturn

_PR_SET_NO_NEW_PRIVS = 38
_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
EXIT_CONFINE_FAILED = 126
_LIMIT_FLAGS = ("--oom-score-adj", "--shm")
_LIMITS: dict[str, str] = {}
"""The resource-limit options (issue 23, finding 6), see limit()."""


def _fail(message: str) -> NoReturn:
    print(f"trainyard confine: {message}", file=sys.stderr, flush=True)
    os._exit(EXIT_CONFINE_FAILED)


def _parse(argv: list[str]) -> tuple[list[str], int | None, int | None, list[tuple[str, bool]], list[str]]:
    cgroups: list[str] = []
    uid: int | None = None
    gid: int | None = None
    expose: list[tuple[str, bool]] = []
    rest = list(argv)
    while rest and rest[0] != "--":
        flag = rest.pop(0)
        if not rest:
            _fail(f"{flag} needs a value")
        value = rest.pop(0)
        if flag == "--cgroup":
            cgroups.append(value)
        elif flag in ("--expose", "--expose-rw"):
            expose.append((value, flag == "--expose-rw"))
        elif flag in _LIMIT_FLAGS:
            _LIMITS[flag] = value
        elif flag in ("--uid", "--gid"):
            try:
                number = int(value)
            except ValueError:
                _fail(f"{flag} must be a number, got {value!r}")
            if flag == "--uid":
                uid = number
            else:
                gid = number
        else:
            _fail(f"unknown option {flag}")
    if not rest[1:]:
        _fail("usage: confine_exec.py [--cgroup DIR]... [--uid N --gid N] -- PROGRAM [ARGS...]")
    if (uid is None) != (gid is None):
        _fail("--uid and --gid go together")
    return cgroups, uid, gid, expose, rest[1:]


def blocked_ancestor(path: str) -> str | None:
    """The first directory from / down to ``path`` that other users may not pass (no o+x)."""
    parts = os.path.realpath(path).strip("/").split("/")
    for depth in range(len(parts) + 1):
        directory = "/" + "/".join(parts[:depth])
        if not os.stat(directory).st_mode & 0o001:
            return directory
    return None


def _mount(libc: ctypes.CDLL, source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        _fail(f"mount {source} on {target}: {os.strerror(ctypes.get_errno())}")


_namespace: list[ctypes.CDLL] = []


def _own_mount_namespace() -> ctypes.CDLL:
    """Enter a private mount namespace (once; expose and the /dev/shm cap share it)."""
    if not _namespace:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNS) != 0:
            _fail(f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}")
        _mount(libc, "none", "/", None, _MS_REC | _MS_PRIVATE, None)  # nothing below goes back to the host
        _namespace.append(libc)
    return _namespace[0]


def limit() -> None:
    """The part's resource limits that are not its cgroups' (issue 23, finding 6), while still root.

    ``--oom-score-adj N``: the agent runs at -1000 (never the kernel's choice) and its children
    inherit that; a worker must be the first choice instead. ``--shm DIR``: a tmpfs of the part's
    own size, made by the agent, replaces /dev/shm in the part's mount namespace: a full /dev/shm is
    the part's alone (the agent reads how full it is from DIR) and the host's stays free."""
    adj = _LIMITS.get("--oom-score-adj")
    if adj is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write(str(int(adj)))
        except (OSError, ValueError) as exc:
            _fail(f"cannot set oom_score_adj {adj}: {exc}")
    shm = _LIMITS.get("--shm")
    if shm is not None:
        libc = _own_mount_namespace()
        _mount(libc, shm, "/dev/shm", None, _MS_BIND, None)


def expose(paths: list[tuple[str, bool]]) -> None:
    """Make each of ``paths`` (a directory, and whether it stays writable) reachable by any uid, in a
    private mount namespace (see above)."""
    wanted = []
    for path, writable in paths:
        real = os.path.realpath(path)
        blocked = blocked_ancestor(real)
        if blocked is not None:
            wanted.append((blocked, real, writable))
    if not wanted:
        return
    libc = _own_mount_namespace()
    # Opened in the new namespace (a bind source must be in it), before the tmpfs hides them.
    plans = [(blocked, real, writable, os.open(real, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
             for blocked, real, writable in wanted]
    covered: list[str] = []
    for blocked in sorted({b for b, _, _, _ in plans}, key=len):
        if not any(blocked == c or blocked.startswith(c + "/") for c in covered):
            _mount(libc, "tmpfs", blocked, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
            covered.append(blocked)
    os.umask(0o022)
    for _, real, writable, fd in plans:
        os.makedirs(real, mode=0o755, exist_ok=True)
        _mount(libc, f"/proc/self/fd/{fd}", real, None, _MS_BIND | _MS_REC, None)
        # A venv being built (--expose-rw) stays writable by its uid; nothing is setuid or a device.
        read_only = 0 if writable else _MS_RDONLY
        _mount(libc, "none", real, None, _MS_REMOUNT | _MS_BIND | read_only | _MS_NOSUID | _MS_NODEV, None)
        os.close(fd)


def main(argv: list[str]) -> None:
    cgroups, uid, gid, exposed, command = _parse(argv)
    for cgroup in cgroups:  # the tracking cgroup, then those of the limits in cgroup v1 hierarchies
        try:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
                procs.write(str(os.getpid()))
        except OSError as exc:
            _fail(f"cannot join the attempt's cgroup {cgroup}: {exc}")
    try:
        limit()
    except OSError as exc:
        _fail(f"cannot set the part's limits: {exc}")
    if exposed:
        try:
            expose(exposed)
        except OSError as exc:
            _fail(f"cannot expose {exposed} to the workers: {exc}")
    if uid is not None and gid is not None:
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as exc:
            _fail(f"cannot switch to uid {uid} gid {gid}: {exc}")
        if os.getuid() != uid or os.geteuid() != uid or os.getegid() != gid:
            _fail(f"still not uid {uid} gid {gid} after switching")
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            _fail(f"prctl(PR_SET_NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}")
    os.umask(0o077)
    try:
        os.execv(command[0], command)
    except OSError as exc:
        _fail(f"cannot start {command[0]}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
