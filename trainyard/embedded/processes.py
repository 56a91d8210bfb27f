"""Processes and ports of the embedded servers: free loopback ports, process groups, exits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass


LOOPBACK = "127.0.0.1"


class EmbeddedError(RuntimeError):
    """An embedded server could not be started or stopped."""



# --------------------------------------------------------------------------------------------------
# ports


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port that nothing listens on right now (the OS picks it; it may be taken again later)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """``count`` distinct free TCP ports: all are held open together, so no two are the same."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR, as servers (weed, uvicorn)
    set it: connections of an earlier server lingering in TIME_WAIT do not make a port busy."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True



def _pid_alive(pid: int) -> bool:
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil comes with pgserver
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False

def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the process group ``proc`` leads (it was started with start_new_session);
    to ``proc`` alone when it leads no group, so the caller's own group is never hit."""
    if proc.returncode is not None:
        return  # reaped: its pid may name someone else by now
    try:
        leads_group = os.getpgid(proc.pid) == proc.pid
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if leads_group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)


def has_exited(proc: subprocess.Popen[Any]) -> bool:
    """Whether ``proc`` has exited, without reaping it (unlike ``Popen.poll``): while unreaped its
    pid, which names its process group, cannot be given to an unrelated process."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None
    except ChildProcessError:  # reaped by someone else
        return not _pid_alive(proc.pid)


def wait_exited(proc: subprocess.Popen[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` for ``proc`` to exit, leaving it unreaped. True if it exited."""
    deadline = time.monotonic() + timeout
    while not has_exited(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stop_process_group(proc: subprocess.Popen[Any], timeout: float) -> int | None:
    """TERM ``proc``'s process group, KILL what is left of it after ``timeout`` (the leader may be
    gone while members remain), then reap ``proc`` and return its exit code."""
    if not has_exited(proc):
        signal_group(proc, signal.SIGTERM)
        wait_exited(proc, timeout)
    signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode
