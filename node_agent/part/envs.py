"""Jobs' requirements on this node: one virtualenv per content hash, built once, shared, evicted LRU.

A job's requirements (trainyard/protocol/requirements.py) are installed into
``work_dir/envs/<key>``, where the key hashes what decides the result: the requirement lines, the
interpreter the venv is built on (its path, prefix, version and package directories) and the
constraints that apply (the agent's ``--pip-constraint`` file and a pin of the interpreter's own
torch, so a job never replaces, or downloads, torch). Attempts and jobs that ask for the same key
share the venv; it is built once even when several ask at once (a lock file per key, which also
holds between agents sharing a work dir), and reused until evicted.

The venv is made with ``--without-pip`` and a ``.pth`` file that adds the interpreter's own package
directories after the venv's: the workers see torch, trainyard and pip from the node, and the
job's packages first. This works whether the node's interpreter is a system Python or itself a
venv (``--system-site-packages`` would see only the base interpreter's packages). pip runs with
``--only-binary :all:`` (installing wheels runs none of their code; the requirement lines name
packages, never a URL or a path, which pip would build from source: trainyard/protocol/requirements.py)
and an allow-listed part of the agent's environment (``build_env``: PATH, the locale, the proxy and
CA variables and the operator's PIP_* settings; never TRAINYARD_* or anything else of the agent's).

Nothing of the build runs as root (docs/security.md, "Interpreters and venvs"): where the agent has
a uid pool, the interpreter probe, ``python -m venv`` and pip run as the part's own uid
(``build_as``), through the confine wrapper and in the part's cgroup, in a venv directory and a
scratch directory that uid owns; pip then reads ``--find-links`` paths only as that uid could. After
each step every process left in the part's cgroup or of its uid is killed (a daemon the build left
behind), and the tree is checked only once none is left; the part keeps its uid until its build has
returned, a stop included (node_agent/part/attempt.py). Root then checks the result without executing
anything in it (node_agent/part/venv_checks.py: the interpreter links and ``pyvenv.cfg`` as ``python -m
venv`` made them, no other link, nothing setuid or special), never following a link the uid left,
and gives the tree to root, read-only to everyone: worker uids can read and run it, never change it. The requirements
text (index URLs may carry tokens) lives only in the scratch directory, removed after the build,
and the cache's root is 0711: a worker can run a venv whose key it knows, not list or read the
others. An agent that is not root (no pool) builds as itself. A venv is complete once its marker
(``trainyard-env.json``, a small regular file of root's, created by root after the seal) exists; a
directory without one is a build that died and is rebuilt.

The cache keeps at most ``max_count`` venvs and ``max_bytes``: past either, the least recently used
that no live attempt holds are removed (``evictions``, a pure policy).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from node_agent.confinement import safe_files
from node_agent.confinement.isolation import Confinement, hidden_paths
from node_agent.part.venv_checks import VenvTampered, changed, seal, shape
from trainyard.protocol.requirements import requirement_lines

MARKER = "trainyard-env.json"
SCRATCH = ".build-"
"""In the cache's root, with the key: one directory per build, its uid's (the requirements, pip's HOME
and TMPDIR), removed when the build ends."""
KEY_FORMAT = "trainyard-env-2"
"""2: built as the part's uid and checked (issue 23); a venv of format 1 (built as root, never
checked) is never used again, only evicted."""
PINNED_FROM_NODE = ("torch",)
"""Packages of the node's interpreter that a job's requirements may not replace."""
ERROR_LINES = 6
"""Lines of pip's output kept in the reason an install failed."""
MARKER_LIMIT = 4096
"""The most a marker may hold: it is read without following a link and no further than this."""
OUTPUT_LIMIT = 256 * 1024
"""The most of a build step's output read back (its tail), whatever the step wrote."""
REAP_TIMEOUT_S = 10.0
"""How long the processes a build step left behind may take to die after SIGKILL."""
LOCK_POLL_S = 0.2
"""How often a part waiting for another's build of the same venv looks whether it was stopped."""
BUILD_ENV_NAMES = ("PATH", "LANG", "LANGUAGE", "TZ", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
                   "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "SSL_CERT_FILE", "SSL_CERT_DIR",
                   "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
"""The agent's variables the probe, ``python -m venv`` and pip see (with LC_*, and PIP_* for pip:
the operator's pip settings); nothing else of the agent's (its join token, its cloud credentials)."""
PROBE = """
import json, site, sys, sysconfig
from importlib import metadata
paths = sysconfig.get_paths()
dirs = list(dict.fromkeys([*site.getsitepackages(), paths["purelib"], paths["platlib"]]))
pins = {}
for name in NAMES:
    try:
        pins[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps({"version": sys.version, "prefix": sys.prefix, "site": dirs, "pins": pins,
                  "lib": "python%d.%d" % sys.version_info[:2]}))
"""


class EnvBuildFailed(RuntimeError):
    """The job's requirements could not be installed (one line: the reason the attempt fails with)."""


def build_env(agent_env: Mapping[str, str], *, home: str, pip: bool) -> dict[str, str]:
    """The environment of a build step: an allow-list of the agent's (BUILD_ENV_NAMES, LC_*, and for
    pip PIP_*), HOME and TMPDIR the build's own, and pip never asking."""
    prefixes = ("LC_", "PIP_") if pip else ("LC_",)
    env = {k: v for k, v in agent_env.items() if k in BUILD_ENV_NAMES or k.startswith(prefixes)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(HOME=home, TMPDIR=home)
    if pip:
        env["PIP_NO_INPUT"] = "1"
    return env


def _build_processes(build_as: Confinement) -> list[psutil.Process]:
    """The live processes of the build's uid (every one is the part's: the uid is leased to it)."""
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info.get("uids")
        if uids is not None and proc.info.get("status") != psutil.STATUS_ZOMBIE and build_as.uid in uids:
            found.append(proc)
    return found


def kill_build(build_as: Confinement) -> list[int]:
    """SIGKILL every process of the part's cgroup and of its uid, once; the pids found alive."""
    left: set[int] = set()
    if build_as.cgroup is not None:
        build_as.cgroup.kill()
        left |= build_as.cgroup.pids()
    if build_as.uid is not None:
        for proc in _build_processes(build_as):
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)  # psutil checks it is still that process
                left.add(proc.pid)
    return sorted(left)


def end_build(build_as: Confinement | None, timeout_s: float = REAP_TIMEOUT_S) -> list[int]:
    """Kill what a build step left behind (a daemon: setsid and a double fork leave neither the
    cgroup nor the uid) until none is left; the pids still alive after ``timeout_s`` ([]: none)."""
    if build_as is None:
        return []  # built as the agent itself: nothing tells its processes from the agent's
    deadline = time.monotonic() + timeout_s
    while True:
        left = kill_build(build_as)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)  # the kernel delivers SIGKILL asynchronously: poll until the deadline


@dataclass(frozen=True)
class Interpreter:
    """What the key and the build need to know of the interpreter a venv is built on."""

    path: str
    version: str
    prefix: str
    site: tuple[str, ...]
    pins: tuple[tuple[str, str], ...]
    lib: str


@dataclass(frozen=True)
class CachedEnv:
    """A complete venv of the cache, as the eviction policy sees it."""

    key: str
    last_used: float
    size_bytes: int


def env_key(lines: list[str], interpreter: Interpreter, constraints: str) -> str:
    """The content hash naming a venv: what it is built from, nothing else."""
    content = {"format": KEY_FORMAT, "requirements": lines, "python": interpreter.path,
               "version": interpreter.version, "prefix": interpreter.prefix, "site": list(interpreter.site),
               "constraints": constraints}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def constraints_text(agent_constraints: str, interpreter: Interpreter) -> str:
    """The constraints that apply: the agent's file, then a pin of each of the node's own packages
    a job may not replace."""
    pins = "".join(f"{name}=={version}\n" for name, version in interpreter.pins)
    return agent_constraints.rstrip("\n") + ("\n" if agent_constraints.strip() else "") + pins


def evictions(envs: list[CachedEnv], *, max_count: int, max_bytes: int, in_use: set[str]) -> list[str]:
    """The keys to remove, least recently used first, until at most ``max_count`` venvs and
    ``max_bytes`` remain; a venv in use is never chosen (the cache may then stay over its limits)."""
    count, size = len(envs), sum(e.size_bytes for e in envs)
    chosen: list[str] = []
    for env in sorted(envs, key=lambda e: (e.last_used, e.key)):
        if count <= max_count and size <= max_bytes:
            break
        if env.key in in_use:
            continue
        chosen.append(env.key)
        count, size = count - 1, size - env.size_bytes
    return chosen


class EnvCache:
    """The venvs of one agent's work dir. Thread-safe; ``acquire`` may take minutes (pip)."""

    def __init__(self, root: Path, *, constraints_file: Path | None = None, max_count: int = 8,
                 max_bytes: int = 20 * 2**30, build_timeout_s: float = 1800.0) -> None:
        self.root = root
        self.constraints_file = constraints_file
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.build_timeout_s = build_timeout_s
        self._lock = threading.Lock()
        self._users: dict[str, int] = {}
        self._interpreters: dict[str, Interpreter] = {}

    # --- keys ---

    def interpreter(self, python: str, build_as: Confinement | None = None) -> Interpreter:
        """The interpreter at ``python`` as the key sees it (asked once per path, as ``build_as``'s
        uid when given: never root)."""
        with self._lock:
            known = self._interpreters.get(python)
        if known is not None:
            return known
        code = PROBE.replace("NAMES", repr(PINNED_FROM_NODE))
        asked = f"ask the interpreter {python} about its packages"
        output = _run(_as(build_as, [python, "-I", "-c", code]), asked, 60, build_env(os.environ, home="/", pip=False),
                      build_as, merge=False)
        try:
            facts = json.loads(output)
        except ValueError as exc:
            raise EnvBuildFailed(f"could not {asked}: {exc}") from exc
        if not isinstance(facts, dict):
            raise EnvBuildFailed(f"could not {asked}: it printed no facts")
        found = Interpreter(path=python, version=facts["version"], prefix=facts["prefix"],
                            site=tuple(facts["site"]), pins=tuple(sorted(facts["pins"].items())), lib=facts["lib"])
        with self._lock:
            self._interpreters[python] = found
        return found

    def key(self, requirements: str, python: str, build_as: Confinement | None = None) -> tuple[str, Interpreter, str]:
        """The venv's key, the interpreter it is built on, and the constraints that apply."""
        interpreter = self.interpreter(python, build_as)
        try:
            agent_constraints = self.constraints_file.read_text() if self.constraints_file else ""
        except OSError as exc:
            raise EnvBuildFailed(f"the agent's pip constraints {self.constraints_file} cannot be read: {exc}") from exc
        constraints = constraints_text(agent_constraints, interpreter)
        return env_key(requirement_lines(requirements), interpreter, constraints), interpreter, constraints

    # --- use ---

    def acquire(self, requirements: str, python: str, build_as: Confinement | None = None,
                cancelled: Callable[[], bool] | None = None) -> tuple[str, str]:
        """The venv for these requirements on ``python``, built if it is not there: (its key, its
        python). The caller holds it until ``release(key)``: it is not evicted meanwhile.
        ``build_as``: the unprivileged uid (and what it must see, its cgroup) that probes and builds;
        None: the agent itself (an agent that is not root). ``cancelled``: whether the part was
        stopped meanwhile (then no build starts, and no wait for another's goes on)."""
        if build_as is not None and build_as.uid is None:
            build_as = None
        key, interpreter, constraints = self.key(requirements, python, build_as)
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        # Worker uids run the venvs' pythons by their paths, but cannot list which venvs exist.
        os.chmod(self.root, 0o711)
        venv = self.root / key
        with self._key_lock(key, cancelled=cancelled) as locked:
            if not locked:
                raise EnvBuildFailed("the part was stopped while another built its venv")
            with self._lock:
                self._users[key] = self._users.get(key, 0) + 1
            try:
                if not _complete(venv):
                    if cancelled is not None and cancelled():
                        raise EnvBuildFailed("the part was stopped before its venv was built")
                    self._build(venv, requirements, interpreter, constraints, build_as)
                os.utime(venv / MARKER, follow_symlinks=False)  # last used
            except BaseException:
                self.release(key)
                raise
        self._evict()
        return key, str(venv / "bin" / "python")

    def release(self, key: str) -> None:
        with self._lock:
            left = self._users.get(key, 0) - 1
            if left > 0:
                self._users[key] = left
            else:
                self._users.pop(key, None)

    def in_use(self) -> set[str]:
        """The keys live attempts hold."""
        with self._lock:
            return set(self._users)

    def hold(self, key: str) -> None:
        """Mark a venv in use without building it (an attempt re-adopted after an agent restart)."""
        with self._lock:
            self._users[key] = self._users.get(key, 0) + 1

    def cached(self) -> list[CachedEnv]:
        """The complete venvs of the cache."""
        found = []
        for marker in self.root.glob(f"*/{MARKER}"):
            # Never through a link, nor past a small limit (a venv a uid left half-built is no proof).
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                facts = json.loads(safe_files.read_file(marker.parent, MARKER, limit=MARKER_LIMIT, owner=os.geteuid()))
                found.append(CachedEnv(key=marker.parent.name, last_used=marker.lstat().st_mtime,
                                       size_bytes=int(facts["size_bytes"])))
        return found

    # --- build and evict ---

    @contextlib.contextmanager
    def _key_lock(self, key: str, *, wait: bool = True, cancelled: Callable[[], bool] | None = None) -> Iterator[bool]:
        """Hold the key's lock (True), or False when it is held elsewhere and ``wait`` is False, or
        ``cancelled()`` turned true while waiting for it."""
        locks = self.root / ".locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait and cancelled is None else fcntl.LOCK_NB))
                    break
                except BlockingIOError:
                    if not wait or (cancelled is not None and cancelled()):
                        yield False
                        return
                    time.sleep(LOCK_POLL_S)  # a flock cannot be waited for and interrupted at once
            yield True
        finally:
            os.close(fd)  # and the lock with it

    def _build(self, venv: Path, requirements: str, interpreter: Interpreter, constraints: str,
               build_as: Confinement | None = None) -> None:
        scratch = self.root / f"{SCRATCH}{venv.name}"
        for leftover in (venv, scratch):
            if leftover.exists() or leftover.is_symlink():
                shutil.rmtree(leftover)  # a build that died: no marker
        started = time.monotonic()
        try:
            venv.mkdir(mode=0o700)
            scratch.mkdir(mode=0o700)
            for name, text in (("requirements.txt", requirements), ("constraints.txt", constraints)):
                fd = os.open(scratch / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
            if build_as is not None:
                assert build_as.uid is not None and build_as.gid is not None
                for path in (venv, scratch, scratch / "requirements.txt", scratch / "constraints.txt"):
                    os.lchown(path, build_as.uid, build_as.gid)
            # Below a private directory (a 0700 work dir's parent), the uid gets both, writable, in
            # its own mount namespace.
            writable = hidden_paths([str(venv), str(scratch)])
            _run(_as(build_as, [interpreter.path, "-I", "-m", "venv", "--without-pip", str(venv)], writable),
                 "create the virtualenv", 120, build_env(os.environ, home=str(scratch), pip=False), build_as)
            made = shape(venv)
            # addsitedir (not a bare path): the node's own .pth files (editable installs) apply too.
            # Written by root into the uid's directory: never through a link it could have left.
            text = "".join(f"import site; site.addsitedir({d!r})\n" for d in interpreter.site)
            try:
                safe_files.create_file(venv, "lib", interpreter.lib, "site-packages", "_trainyard_node.pth",
                                       data=text.encode(), mode=0o644)
            except OSError as exc:
                raise VenvTampered(f"the venv's site-packages is not a plain directory: {exc}") from exc
            _run(_as(build_as, [str(venv / "bin" / "python"), "-I", "-m", "pip", "install",
                                "--disable-pip-version-check", "--no-input", "--only-binary", ":all:",
                                "-r", str(scratch / "requirements.txt"), "-c", str(scratch / "constraints.txt")],
                     writable),
                 "install the job's requirements", self.build_timeout_s,
                 build_env(os.environ, home=str(scratch), pip=True), build_as)
            # Nothing of the build runs any more (_run killed what it left): checked and sealed as is.
            size = seal(venv, owner=0 if build_as is not None else None)
            tampered = changed(made, venv)
            if tampered is not None:
                raise VenvTampered(tampered)
            facts = {"python": interpreter.path, "size_bytes": size, "build_s": round(time.monotonic() - started, 3)}
            try:
                # Created, never opened: a name the build left there (a link to /etc/shadow) is refused.
                safe_files.create_file(venv, MARKER, data=json.dumps(facts).encode(), mode=0o644)
            except FileExistsError as exc:
                raise VenvTampered(f"the job's requirements left a {MARKER} in the venv") from exc
        except VenvTampered as exc:
            shutil.rmtree(venv, ignore_errors=True)
            raise EnvBuildFailed(f"the venv built for the job's requirements is refused: {exc}") from exc
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # the requirements text (index tokens) with it

    def _evict(self) -> None:
        for key in evictions(self.cached(), max_count=self.max_count, max_bytes=self.max_bytes, in_use=self.in_use()):
            # Never one being built or acquired right now (its lock is held), nor one taken since.
            with self._key_lock(key, wait=False) as locked:
                with self._lock:
                    if not locked or key in self._users:
                        continue
                (self.root / key / MARKER).unlink(missing_ok=True)  # incomplete from here on
                shutil.rmtree(self.root / key, ignore_errors=True)


def _as(build_as: Confinement | None, command: list[str], writable: tuple[str, ...] = ()) -> list[str]:
    """``command`` as ``build_as``'s uid (through the confine wrapper), else as the agent itself."""
    return command if build_as is None else build_as.wrap(command, writable=writable)


def _complete(venv: Path) -> bool:
    """The venv's marker is there: a regular file of the agent's user (root's), not a link."""
    try:
        info = os.lstat(venv / MARKER)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def _run(command: list[str], what: str, timeout_s: float, env: dict[str, str], build_as: Confinement | None,
         *, merge: bool = True) -> bytes:
    """Run one build step as ``build_as``; its output (stdout, with stderr when ``merge``). Whatever
    it left running is killed before this returns (end_build). The output goes to files of root's,
    not pipes: a daemon holding a pipe open would keep a reader waiting until the timeout."""
    program = command[command.index("--") + 1:] if "--" in command else command
    module = Path(program[program.index("-m") + 1] if "-m" in program else program[0]).name
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code: int | None = None
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=out if merge else err, env=env, cwd="/")
        except OSError as exc:
            raise EnvBuildFailed(f"could not {what}: {exc}") from exc
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        finally:
            left = end_build(build_as)
        output, errors = _read_tail(out), _read_tail(err)
    if left:
        raise EnvBuildFailed(f"could not {what}: processes {left[:5]} of its uid survived SIGKILL")
    if code is None:
        raise EnvBuildFailed(f"could not {what} within {timeout_s:g}s: {_tail(output.decode(errors='replace'))}")
    if code != 0:
        said = (output if merge else errors).decode(errors="replace")
        raise EnvBuildFailed(f"could not {what} ({module} exit {code}): {_tail(said, ERROR_LINES if merge else 1)}")
    return output


def _read_tail(file: Any) -> bytes:
    """At most OUTPUT_LIMIT bytes of the end of what a step wrote to ``file``."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(0, size - OUTPUT_LIMIT))
    return bytes(file.read(OUTPUT_LIMIT))


def _tail(output: str, lines: int = ERROR_LINES) -> str:
    """What pip said went wrong, on one line: its last ERROR lines, else its last lines."""
    kept = [line.strip() for line in output.splitlines() if line.strip() and not line.lstrip().startswith("[notice]")]
    errors = [line.removeprefix("ERROR:").strip() for line in kept if line.startswith("ERROR:")]
    return " | ".join(errors[-2:] if errors else kept[-lines:]) or "no output"
