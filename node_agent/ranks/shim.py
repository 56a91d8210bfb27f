"""The process torchrun starts for each rank: it runs the real training process and records it.

    python -m node_agent.ranks.shim [--log-dir DIR] (module|file) ENTRYPOINT [ARGS...]
    python -m node_agent.ranks.shim [--log-dir DIR] command PROGRAM [ARGS...]

torchrun only knows its direct children and reports their exit as an opaque failure. The shim sits
between torchrun and the training code so that the agent learns, from one small file per rank,
the real worker's pid and its exact exit code, even when the worker is SIGKILLed:

    $TRAINYARD_STATUS_DIR/rank-<RANK>.json
        {rank, local_rank, pid, state: starting|running|exited, exit_code, started_at, ended_at}

The file is replaced atomically (write + rename), so a reader sees either the old or the new
state. exit_code is negative when the worker died by a signal; the shim itself then exits with
128 + signal, like a shell, because torchrun reads a negative exit of its child as "the shim was
killed".

With TRAINYARD_STANDBY_DIR set (the agent keeps warm standbys: node_agent/ranks/standby.py), the shim
first offers the rank to a standby, which becomes the worker without a cold interpreter start; the
record then says ``"standby": true`` and everything else (pid, signals, exit code) is as above. No
standby warm, or one that declines (another interpreter, other startup variables): a cold start.

With --log-dir, the worker's stdout and stderr go to DIR/rank-<RANK>/{stdout,stderr}.log, one
pair per global rank, which the agent tails and ships.

``command``: a job that brings its own launcher (LaunchSpec.command). The agent starts one shim per
node in place of torchrun, and the shim runs PROGRAM (found on PATH as the job's uid, or a path) as
the node's whole part: its record is the node's first global rank (node rank x processes per node,
local rank 0), its exit the part's, its output the part's log. No warm standby takes it, and it
does not die with its parent (the agent, which may restart while the job runs on).

This module must stay import-light (stdlib only, no torch, no pydantic): it runs once per rank
before the training code and its start time adds to every launch.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from node_agent.ranks.standby_claim import StandbyWorker, claim
from trainyard.protocol.env import (  # standard library only
    ENV_JOB_ENV,
    ENV_NNODES,
    ENV_NODE_RANK,
    ENV_NPROC_PER_NODE,
    ENV_STANDBY_DIR,
    ENV_STATUS_DIR,
    global_rank,
    job_env_problem,
)
from trainyard.protocol.exits import TAIL_BYTES, classify

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_PR_SET_PDEATHSIG = 1
USAGE = "usage: python -m node_agent.ranks.shim [--log-dir DIR] (module|file|command) ENTRYPOINT [ARGS...]"


def _now() -> str:
    return datetime.now(UTC).isoformat()


def rank_file(status_dir: Path, rank: int) -> Path:
    return status_dir / f"rank-{rank}.json"


def rank_log_dir(log_dir: Path, rank: int) -> Path:
    return log_dir / f"rank-{rank}"


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def child_command(kind: str, entrypoint: str, args: list[str]) -> list[str]:
    if kind == "module":
        return [sys.executable, "-m", entrypoint, *args]
    if kind == "file":
        return [sys.executable, entrypoint, *args]
    if kind == "command":
        return [entrypoint, *args]  # exec'd as is: PATH lookup in the child's env, as the job's uid
    raise ValueError(f"unknown entrypoint kind {kind!r} (expected 'module', 'file' or 'command')")


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """The training process's environment: the shim's own (the platform's, from the agent) with
    the job's env (ENV_JOB_ENV) on top. Only the training process sees the job's variables;
    PYTHONPATH is appended to the platform's, never put in front of it. A name the platform
    keeps (trainyard.protocol.env, job_env_problem) is left out with a line on stderr: the control
    plane refuses it at submit, so only a spec from elsewhere carries one."""
    env = dict(environ)
    env.pop(ENV_STANDBY_DIR, None)  # the shim's business, whichever way the rank starts
    raw = env.pop(ENV_JOB_ENV, None)
    try:
        job = json.loads(raw) if raw else {}
    except ValueError:
        job = None
    if not isinstance(job, dict):
        print(f"rank_shim: {ENV_JOB_ENV} is not a JSON object; the job's env is not applied", file=sys.stderr)
        return env
    for name, value in job.items():
        problem = job_env_problem(name, value) if isinstance(value, str) else f"env value of {name!r} is not a string"
        if problem is not None:
            print(f"rank_shim: {problem}; left out", file=sys.stderr)
        elif name == "PYTHONPATH":
            env[name] = os.pathsep.join(filter(None, (env.get(name, ""), value)))
        else:
            env[name] = value
    return env


def _make_preexec(parent_pid: int) -> Any:
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        # The worker must not outlive the shim: if the shim is SIGKILLed (by torchrun or by the
        # agent), nobody would be left to record or reap the worker.
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The shim may have died between fork and prctl; the death signal would then never come.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _start(
    kind: str, entrypoint: str, args: list[str], stdout: Any, stderr: Any, rank: int
) -> subprocess.Popen[bytes] | StandbyWorker:
    """The worker: a warm standby's when one takes the rank, else a new interpreter."""
    env = child_env(dict(os.environ))
    standby_dir = os.environ.get(ENV_STANDBY_DIR)
    if standby_dir and kind != "command":
        # Without --log-dir a cold worker inherits the shim's stdout and stderr; so does this one.
        stdio = [f.fileno() if f is not None else fd for f, fd in ((stdout, 1), (stderr, 2))]
        worker, why = claim(Path(standby_dir), kind, entrypoint, args, env, cwd=os.getcwd(), stdio=stdio)
        if worker is not None:
            return worker
        print(f"rank_shim: rank {rank} starts cold: {why}", file=sys.stderr)
    return subprocess.Popen(
        child_command(kind, entrypoint, args),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        preexec_fn=_make_preexec(os.getpid()),
    )


def _parse(argv: list[str]) -> tuple[Path | None, str, str, list[str]]:
    log_dir: Path | None = None
    rest = list(argv)
    if rest[:1] == ["--log-dir"] and len(rest) >= 2:
        log_dir = Path(rest[1])
        rest = rest[2:]
    if len(rest) < 2:
        raise SystemExit(USAGE)
    return log_dir, rest[0], rest[1], rest[2:]


def _die_with_parent() -> None:
    # torchrun starts each rank in a session of its own, so nothing else stops the rank if torchrun
    # dies. SIGTERM, not SIGKILL: it is forwarded, and the worker may still exit cleanly.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == 1:  # torchrun was already gone
            os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> NoReturn:
    log_dir, kind, entrypoint, args = _parse(sys.argv[1:] if argv is None else argv)
    restartable = global_rank(os.environ)
    if restartable is not None:
        # torchrun supervises this node only (--standalone): its RANK and WORLD_SIZE are local. The
        # attempt's are derived from the node rank, and its workers join the fenced rendezvous
        # (TRAINYARD_RENDEZVOUS), which no torchrun hosts, so that they can outlive this attempt.
        rank, world = restartable
        node_rank = os.environ.get(ENV_NODE_RANK, "0")
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "GROUP_RANK": node_rank,
                           "GROUP_WORLD_SIZE": os.environ[ENV_NNODES]})
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if kind == "command":
        # No torchrun above: the part is one record, at the node's first global rank.
        rank = int(os.environ.get(ENV_NODE_RANK, "0")) * int(os.environ.get(ENV_NPROC_PER_NODE, "1"))
        local_rank = 0
    status_dir = Path(os.environ.get(ENV_STATUS_DIR) or ".")
    status_dir.mkdir(parents=True, exist_ok=True)
    path = rank_file(status_dir, rank)
    record: dict[str, Any] = {
        "rank": rank,
        "local_rank": local_rank,
        "pid": None,
        "state": "starting",
        "exit_code": None,
        "started_at": _now(),
        "ended_at": None,
    }
    write_json_atomic(path, record)

    child: subprocess.Popen[bytes] | StandbyWorker | None = None
    pending: list[int] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        if child is None:
            # A stop that arrives before the worker exists must still take effect once it does.
            pending.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    if kind != "command":  # a command's parent is the agent, whose restart must not stop the job
        _die_with_parent()

    stdout: Any = None
    stderr: Any = None
    if log_dir is not None:
        rank_dir = rank_log_dir(log_dir, rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        # Append, never truncate: the agent ships these files by byte offset.
        stdout = open(rank_dir / "stdout.log", "ab")  # noqa: SIM115 - handed to the child
        stderr = open(rank_dir / "stderr.log", "ab")  # noqa: SIM115

    try:
        child = _start(kind, entrypoint, args, stdout, stderr, rank)
    except (OSError, ValueError) as exc:
        print(f"rank_shim: cannot start worker: {exc}", file=sys.stderr)
        if stderr is not None:  # in the job's own log too, where its user looks
            stderr.write(f"trainyard: cannot start {entrypoint!r}: {exc}\n".encode())
        record.update(state="exited", exit_code=127, ended_at=_now())
        write_json_atomic(path, record)
        sys.exit(127)
    finally:
        for f in (stdout, stderr):
            if f is not None:
                f.close()

    if isinstance(child, StandbyWorker):
        record["standby"] = True
    record.update(state="running", pid=child.pid)
    write_json_atomic(path, record)
    for signum in pending:
        forward(signum, None)

    code = child.wait()
    record.update(state="exited", exit_code=code, ended_at=_now())
    if code != 0:
        # Why, in the worker's own words (the end of its stderr): the control plane shows it, and
        # fails the job at once when the script could not even start.
        tail = _tail(rank_log_dir(log_dir, rank) / "stderr.log") if log_dir is not None else ""
        record["cause"], record["message"] = classify(code, tail)
    write_json_atomic(path, record)
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
