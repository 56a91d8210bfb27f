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
``--only-binary :all:`` (installing wheels runs none of their code) and the agent's environment
(PIP_INDEX_URL and the rest apply).

Nothing of the build runs as root (docs/security.md, "Interpreters and venvs"): where the agent has
a uid pool, the interpreter probe, ``python -m venv`` and pip run as the part's own uid
(``build_as``), through the confine wrapper, in a venv directory and a scratch directory that uid
owns; pip then reads ``--find-links`` and ``file://`` paths only as that uid could. Root then checks
the result without executing anything in it (node_agent/venv_checks.py: the interpreter links and
``pyvenv.cfg`` as ``python -m venv`` made them, nothing setuid or special) and gives the tree to
root, read-only to everyone: worker uids can read and run it, never change it. The requirements
text (index URLs may carry tokens) lives only in the scratch directory, removed after the build,
and the cache's root is 0711: a worker can run a venv whose key it knows, not list or read the
others. An agent that is not root (no pool) builds as itself. A venv is complete once its marker
(``trainyard-env.json``) exists; a directory without one is a build that died and is rebuilt.

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
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from node_agent.isolation import Confinement, hidden_paths
from node_agent.venv_checks import VenvTampered, changed, seal, shape
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
        try:
            done = subprocess.run(_as(build_as, [python, "-I", "-c", code]), capture_output=True, timeout=60,
                                  check=False, cwd="/", stdin=subprocess.DEVNULL)
            facts = json.loads(done.stdout) if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            raise EnvBuildFailed(f"the interpreter {python} cannot be asked about its packages: {exc}") from exc
        if not isinstance(facts, dict):
            raise EnvBuildFailed(f"the interpreter {python} cannot be asked about its packages: "
                                 f"{_tail(done.stderr.decode(errors='replace'), 1)}")
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

    def acquire(self, requirements: str, python: str, build_as: Confinement | None = None) -> tuple[str, str]:
        """The venv for these requirements on ``python``, built if it is not there: (its key, its
        python). The caller holds it until ``release(key)``: it is not evicted meanwhile.
        ``build_as``: the unprivileged uid (and what it must see) that probes and builds; None: the
        agent itself (an agent that is not root)."""
        if build_as is not None and build_as.uid is None:
            build_as = None
        key, interpreter, constraints = self.key(requirements, python, build_as)
        self.root.mkdir(mode=0o711, parents=True, exist_ok=True)
        # Worker uids run the venvs' pythons by their paths, but cannot list which venvs exist.
        os.chmod(self.root, 0o711)
        venv = self.root / key
        with self._key_lock(key):
            with self._lock:
                self._users[key] = self._users.get(key, 0) + 1
            try:
                if not (venv / MARKER).is_file():
                    self._build(venv, requirements, interpreter, constraints, build_as)
                os.utime(venv / MARKER)  # last used
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
            with contextlib.suppress(OSError, ValueError, KeyError):
                facts = json.loads(marker.read_text())
                found.append(CachedEnv(key=marker.parent.name, last_used=marker.stat().st_mtime,
                                       size_bytes=int(facts["size_bytes"])))
        return found

    # --- build and evict ---

    @contextlib.contextmanager
    def _key_lock(self, key: str, *, wait: bool = True) -> Iterator[bool]:
        locks = self.root / ".locks"
        locks.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(locks / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
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
            env = {"HOME": str(scratch), "TMPDIR": str(scratch)}
            _run(_as(build_as, [interpreter.path, "-I", "-m", "venv", "--without-pip", str(venv)], writable),
                 "create the virtualenv", 120, env)
            made = shape(venv)
            site = venv / "lib" / interpreter.lib / "site-packages"
            # addsitedir (not a bare path): the node's own .pth files (editable installs) apply too.
            # Written by root into the uid's directory: never through a link it could have left.
            if site.is_symlink() or not site.is_dir():
                raise VenvTampered(f"the venv's {site.relative_to(venv)} is not a directory")
            fd = os.open(site / "_trainyard_node.pth", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "w") as f:
                f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in interpreter.site))
            _run(_as(build_as, [str(venv / "bin" / "python"), "-I", "-m", "pip", "install",
                                "--disable-pip-version-check", "--no-input", "--only-binary", ":all:",
                                "-r", str(scratch / "requirements.txt"), "-c", str(scratch / "constraints.txt")],
                     writable),
                 "install the job's requirements", self.build_timeout_s, env)
            # Nothing of the build runs any more: what the uid left is checked and sealed as is.
            size = seal(venv, owner=0 if build_as is not None else None)
            tampered = changed(made, venv)
            if tampered is not None:
                raise VenvTampered(tampered)
            facts = {"python": interpreter.path, "size_bytes": size, "build_s": round(time.monotonic() - started, 3)}
            marker = venv / MARKER
            marker.write_text(json.dumps(facts))
            marker.chmod(0o644)
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


def _run(command: list[str], what: str, timeout_s: float, extra_env: dict[str, str] | None = None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TRAINYARD_", "VIRTUAL_ENV"))}
    program = command[command.index("--") + 1:] if "--" in command else command
    try:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              timeout=timeout_s, env={**env, **(extra_env or {}), "PIP_NO_INPUT": "1"}, check=False,
                              cwd="/")
    except subprocess.TimeoutExpired as exc:
        raise EnvBuildFailed(f"could not {what} within {timeout_s:g}s: "
                             f"{_tail((exc.output or b'').decode(errors='replace'))}") from exc
    except OSError as exc:
        raise EnvBuildFailed(f"could not {what}: {exc}") from exc
    if done.returncode != 0:
        module = program[program.index("-m") + 1] if "-m" in program else program[0]
        raise EnvBuildFailed(f"could not {what} ({Path(module).name} "
                             f"exit {done.returncode}): "
                             f"{_tail(done.stdout.decode(errors='replace'))}")


def _tail(output: str, lines: int = ERROR_LINES) -> str:
    """What pip said went wrong, on one line: its last ERROR lines, else its last lines."""
    kept = [line.strip() for line in output.splitlines() if line.strip() and not line.lstrip().startswith("[notice]")]
    errors = [line.removeprefix("ERROR:").strip() for line in kept if line.startswith("ERROR:")]
    return " | ".join(errors[-2:] if errors else kept[-lines:]) or "no output"
