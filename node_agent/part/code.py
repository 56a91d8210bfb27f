"""A job's shipped code on this node (docs/security.md, "Shipped code").

Fetched once per content hash into the work dir's cache (``work_dir/code/<sha256>.tar.gz``, checked
against the hash the control plane gave): the cache is root's alone (0700, archives 0600), so no
worker uid can list which code the node has run or read another tenant's archive. Each attempt's
code is unpacked into its own worker directory (``<worker dir>/code``, the workers' cwd, where the
entrypoint is resolved), which only the attempt's uid may enter.

The archive's bytes are a tenant's: root streams them to disk and hashes them, never parses them.
Unpacking runs in the part's own thread (never the heartbeat's or the long poll's), as the
part's uid in its cgroup (node_agent/part/code_unpack.py, through confine_exec.py), reading the archive
from a file root opened; the download and the unpacking are both capped in bytes and time, the
unpacking in entries too (CodeLimits)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from node_agent.confinement.isolation import Confinement, private_dir
from node_agent.part import code_unpack
from trainyard.protocol.agent import CodeRef

UNPACK_SOURCE = Path(code_unpack.__file__).read_text()
"""Passed with ``-c``: the part's uid runs it without reading any file of the agent's."""


class CodeUnavailable(RuntimeError):
    """The code could not be fetched or unpacked (one line, reported as the part's launch error).
    ``permanent``: the job's own archive is at fault (over a cap, not an archive): another attempt
    would fail the same way, so the job fails at once (start_error) instead of being retried."""

    def __init__(self, message: str, *, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True, kw_only=True)
class CodeLimits:
    """What one job's code may cost a node (agent options ``--code-max-gb``, ``--code-max-entries``,
    ``--code-timeout``)."""

    max_bytes: int = 4 * 2**30
    """The archive's download and its unpacked contents (the sum of its files' sizes), each."""
    max_entries: int = 100_000
    """Files, directories and links in the archive."""
    timeout_s: float = 300.0
    """The download, then the unpacking, each; past it the attempt fails (the node's heartbeats
    never wait for either)."""

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_entries < 1 or not self.timeout_s > 0:
            raise ValueError("code limits must be positive")


Fetch = Callable[[BinaryIO, int, float], None]
"""Writes the archive into the open file, at most that many bytes, by that time.monotonic()
deadline (node_agent/link/client.py: fetch_code); raises what went wrong."""


@dataclass(frozen=True)
class ShippedCode:
    """One part's code: where the node caches it, how to fetch it, what it may cost."""

    ref: CodeRef
    work_dir: Path
    fetch: Fetch
    limits: CodeLimits = CodeLimits()

    def archive(self) -> Path:
        return cached_archive(self.work_dir, self.ref, self.fetch, self.limits)


_fetching: dict[str, threading.Lock] = {}
_fetching_lock = threading.Lock()


def cached_archive(work_dir: Path, ref: CodeRef, fetch: Fetch, limits: CodeLimits = CodeLimits()) -> Path:
    """The archive in the cache, fetched (and checked) if it is not there yet. Parts of one code
    that start together fetch it once (a lock per hash)."""
    cache = private_dir(work_dir / "code")  # also closes a cache an earlier agent left 0755
    path = cache / f"{ref.sha256}.tar.gz"
    if ref.size_bytes > limits.max_bytes:
        raise CodeUnavailable(f"the job's code archive is {ref.size_bytes} bytes, over this node's "
                              f"{limits.max_bytes} (--code-max-gb)", permanent=True)
    with _fetching_lock:
        lock = _fetching.setdefault(ref.sha256, threading.Lock())
    with lock:
        if path.exists() and _sha256(path) == ref.sha256:
            path.chmod(0o600)
            return path
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                # The control plane said the size: a longer body is not that archive.
                fetch(out, ref.size_bytes, time.monotonic() + limits.timeout_s)
            digest = _sha256(tmp)
            if digest != ref.sha256:
                raise CodeUnavailable(f"the job's code arrived with sha256 {digest}, not {ref.sha256}")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


def unpack(archive: Path, into: Path, *, confinement: Confinement | None = None,
           limits: CodeLimits = CodeLimits(), started: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Path:
    """Unpack ``archive`` into ``into``, a new directory, as ``confinement`` says (the attempt's uid
    and cgroup: its workers run and read there, in a worker directory no other uid may enter).
    ``started`` is given the unpacking process (a stop kills it). Raises CodeUnavailable."""
    command = [sys.executable, "-I", "-S", "-c", UNPACK_SOURCE, str(into), str(limits.max_bytes),
               str(limits.max_entries)]
    command = (confinement or Confinement()).wrap(command)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/", "LC_ALL": "C.UTF-8"}
    try:
        fd = os.open(archive, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise CodeUnavailable(f"the job's code archive cannot be opened: {exc}") from exc
    try:
        proc = subprocess.Popen(command, stdin=fd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                cwd=str(into.parent), start_new_session=True)
    except OSError as exc:
        raise CodeUnavailable(f"the job's code could not be unpacked: {exc}") from exc
    finally:
        os.close(fd)
    if started is not None:
        started(proc)
    try:
        _, err = proc.communicate(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise CodeUnavailable(f"the job's code archive took more than {limits.timeout_s:g} s to unpack "
                              f"(this node's limit, --code-timeout)", permanent=True) from None
    lines = err[-4000:].decode(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else f"exit {proc.returncode}"
    if proc.returncode == code_unpack.EXIT_REFUSED:
        raise CodeUnavailable(reason, permanent=True)
    if proc.returncode != 0:
        # Killed (a stop, the cgroup's memory limit) or not started as the uid: not the archive's doing.
        raise CodeUnavailable(f"the job's code could not be unpacked: {reason}")
    return into


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
