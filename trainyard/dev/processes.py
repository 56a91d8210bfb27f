"""Process helpers of ``trainyard dev up``: stopping children and what they left behind, the pid
file that lets the next ``dev up`` end an earlier one's leftovers, the embedded S3's keys."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainyard.embedded import has_exited, signal_group, stop_process_group, wait_exited


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log: IO[bytes]


def s3_credentials(path: Path) -> tuple[str, str]:
    """The embedded S3's keys: made once per data dir and kept, so objects stay readable."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        saved = json.loads(path.read_text())
        return str(saved["access_key"]), str(saved["secret_key"])
    access, secret = f"trainyard-{secrets.token_hex(6)}", secrets.token_urlsafe(24)  # no guessable default
    path.touch(mode=0o600, exist_ok=True)
    path.write_text(json.dumps({"access_key": access, "secret_key": secret}))
    return access, secret


def exit_code(proc: subprocess.Popen[Any]) -> int | None:
    """Exit code (negative: killed by that signal) of an exited child, without reaping it."""
    if proc.returncode is not None:
        return proc.returncode
    with contextlib.suppress(ChildProcessError):
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG)
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    return None


def stop_children(children: list[Child], grace: float) -> None:
    """TERM every child's process group at once, KILL what is left after ``grace``, and end any
    descendant that left its group (an agent's torchrun runs in a session of its own)."""
    strays = [p for child in children if not has_exited(child.proc) for p in descendants(child.proc.pid)]
    for child in children:
        if not has_exited(child.proc):
            signal_group(child.proc, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        wait_exited(child.proc, max(0.0, deadline - time.monotonic()))
    for child in children:
        stop_process_group(child.proc, 0)
        child.log.close()
    kill_all(strays)


def descendants(pid: int) -> list[Any]:
    try:
        import psutil

        return list(psutil.Process(pid).children(recursive=True))
    except Exception:
        return []


def is_training(proc: Any) -> bool:
    """A node's training processes: the workers themselves, each the child of its rank shim. Killing
    them is a crash the shims record (exit -9), as when a worker dies; torchrun stops the rest."""
    try:
        parent = proc.parent().cmdline()
    except Exception:
        return False
    # The shim's own command line starts "python [-u] -m node_agent.ranks.shim" (or its earlier name,
    # for workers an earlier agent started: node_agent/ranks/entry_points.py); torchrun's names the
    # shim too, but as its entrypoint, after "-m node_agent.ranks.torchrun_entry" (or, started by
    # hand, "-m torch.distributed.run").
    from node_agent.ranks.entry_points import RANK_SHIM, TORCHRUN_ENTRY, names

    torchrun = {"torch.distributed.run", *names(TORCHRUN_ENTRY)}
    return bool(set(names(RANK_SHIM)) & set(parent[:4])) and not torchrun & set(parent)


def recorded_workers(workers_dir: Path, agent: int) -> set[int]:
    """The pids of the running workers the rank shims of a node's parts recorded
    (``<workers dir>/<part>/status/rank-N.json``): a worker that started in a warm standby is the
    standby's child, not its shim's, so only the record names it (node_agent/ranks/shim.py). The
    files are the job's to write, so they are read as the agent reads them (safe_files: no link
    followed, no FIFO waited on, a small regular file, a bounded number), and a pid that runs in the
    agent's own cgroup (its standby zygote, an idle standby) is left out; callers keep only the
    agent's descendants."""
    from node_agent.confinement import safe_files

    own = _cgroup(agent)
    pids = set()
    try:
        parts = safe_files.list_dir(workers_dir)[:RECORDED_PARTS_MAX]
    except OSError:
        parts = []
    for part in parts:
        with contextlib.suppress(OSError):
            names = [n for n in safe_files.list_dir(workers_dir, part, "status")
                     if n.startswith("rank-") and n.endswith(".json")][:RECORDED_RANKS_MAX]
            for name in names:
                with contextlib.suppress(OSError, ValueError, AttributeError):
                    record = json.loads(safe_files.read_file(workers_dir, part, "status", name, limit=64 * 1024))
                    pid = record.get("pid")
                    if record.get("exit_code") is None and type(pid) is int and pid > 1:
                        pids.add(pid)
    return {pid for pid in pids if own is None or _cgroup(pid) not in (own, None)}


RECORDED_PARTS_MAX, RECORDED_RANKS_MAX = 256, 1024
"""How many parts' directories and rank files per part a node's records are read from."""


def _cgroup(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None


def kill_all(procs: list[Any]) -> None:
    import psutil

    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()  # psutil checks the pid still names the same process (create time)
    psutil.wait_procs(procs, timeout=5)


def record_pid(path: Path, child: Child) -> None:
    entries = read_pids(path)
    try:
        import psutil

        created = psutil.Process(child.proc.pid).create_time()
    except Exception:
        created = None
    entries.append({"name": child.name, "pid": child.proc.pid, "create_time": created})
    path.write_text(json.dumps(entries))


def read_pids(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, list) else []
    except (OSError, ValueError):
        return []


def kill_leftovers(path: Path, say: Any) -> None:
    """Kill what an earlier ``dev up`` on this data dir left running when it was itself killed."""
    import psutil

    leftovers = []
    for entry in read_pids(path):
        try:
            proc = psutil.Process(int(entry["pid"]))
            if entry.get("create_time") is None or abs(proc.create_time() - float(entry["create_time"])) > 0.01:
                continue
        except (psutil.Error, KeyError, ValueError, TypeError):
            continue
        leftovers.extend([proc, *descendants(proc.pid)])
        say(f"stopping {entry.get('name')} (pid {proc.pid}) left over from an earlier run")
    kill_all(leftovers)
    with contextlib.suppress(OSError):
        path.unlink()
