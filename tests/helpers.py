"""Small test helpers shared by every package's tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from trainyard.embedded import free_port, free_ports, has_exited, port_is_free, signal_group, wait_exited

__all__ = ["ProcessReaper", "free_port", "free_ports", "in_parallel", "rendezvous_port", "wait_for", "pid_gone"]

RENDEZVOUS_PORTS = range(15000, 20000)
"""Below the control plane's rendezvous ports (20000-32767, its dev clusters') and the kernel's
ephemeral range (32768-60999): a port free_port returns can be taken by any outgoing connection
or port-0 bind before torchrun listens on it (CI saw EADDRINUSE)."""


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A free port for a torchrun rendezvous a test starts itself, outside the ephemeral range."""
    for _ in range(200):
        port = random.choice(RENDEZVOUS_PORTS)
        if port_is_free(port, host):
            return port
    raise RuntimeError(f"no free rendezvous port on {host} in {RENDEZVOUS_PORTS}")


def in_parallel(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], timeout: float = 60.0) -> list[Any]:
    """Run ``fn(*args)`` for every args tuple on its own thread, all released at once by a barrier
    (as concurrent requests or replicas would be); their results in order. Raises the first error."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int, args: tuple[Any, ...]) -> None:
        try:
            barrier.wait(timeout)
            results[i] = fn(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, args), daemon=True) for i, args in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise AssertionError(f"{fn.__name__} still running after {timeout}s")
    if errors:
        raise errors[0]
    return results


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
             what: str | Callable[[], str] = "") -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout`` passes (fail,
    saying ``what``; a callable is asked only then, so it can describe the state at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout}s waiting for {said or predicate!r}")
        time.sleep(interval)


def pid_gone(pid: int) -> bool:
    """True once ``pid`` no longer runs (a zombie awaiting its reaper counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class ProcessReaper:
    """Records child processes and kills their process groups at teardown (the ``process_reaper``
    fixture). Start children with ``spawn`` (a new session, so the group is theirs alone), or start
    them with ``start_new_session=True`` yourself and ``add`` them."""

    def __init__(self, grace_s: float = 5.0) -> None:
        self.grace_s = grace_s
        self._procs: list[subprocess.Popen[Any]] = []

    def add(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        self._procs.append(proc)
        return proc

    def spawn(self, args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        kwargs.setdefault("start_new_session", True)
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return self.add(subprocess.Popen(list(args), **kwargs))

    def reap(self) -> None:
        """TERM every recorded group, wait out the grace period, then KILL what is left and reap."""
        procs, self._procs = self._procs, []
        for proc in procs:
            if not has_exited(proc):
                signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for proc in procs:
            wait_exited(proc, max(0.0, deadline - time.monotonic()))
        for proc in procs:
            signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)


STRICT_ENV = "TRAINYARD_TEST_STRICT"
"""Set to 1 (``.ci/run`` does) and a test whose system tool is missing fails instead of skipping."""


def need(condition: bool, reason: str) -> None:
    """Skip the calling test unless ``condition`` (a system tool it needs, e.g. libfaketime, root
    for a tmpfs mount); under TRAINYARD_TEST_STRICT=1 fail instead, so CI cannot pass a fault test
    it never ran."""
    if condition:
        return
    if os.environ.get(STRICT_ENV) == "1":
        pytest.fail(f"{reason} ({STRICT_ENV}=1: missing tools fail rather than skip)", pytrace=False)
    pytest.skip(reason)



def make_wheel(directory: Path, name: str, version: str, source: str) -> Path:
    """A pure-Python wheel of one module ``name`` (its text ``source``) in ``directory``: a real
    package pip installs offline (``--no-index --find-links directory``), with nothing to build."""
    import base64
    import hashlib
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: trainyard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def make_wheel_with(directory: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A wheel of ``files`` (paths inside it, ``<name>-<version>.data/scripts/...`` included: an
    attacker's wheel), with its metadata and RECORD, as pip expects."""
    import base64
    import hashlib
    import zipfile

    info = f"{name}-{version}.dist-info"
    wheel_info = "Wheel-Version: 1.0\nGenerator: trainyard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files = {**files, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": wheel_info}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            info_entry = zipfile.ZipInfo(path)
            info_entry.external_attr = (0o755 if "/scripts/" in path else 0o644) << 16
            zf.writestr(info_entry, text)
    wheel.chmod(0o644)
    return wheel
