"""A hostile job (issue 11, finding 1): run as a job's `.py` entrypoint beside another job on the same
node, it tries to take over the node and the other job, and records for each attack whether it was
blocked. Nothing here harms the other job even when an attack works (signal 0, files opened and
closed unwritten), and nothing read is printed: an attack's record says only whether it got through.

    hostile_job.py VICTIM_JOB_ID [VICTIM_CODE_SHA256]

Its result (rank 0): {"uid": ..., "attacks": [{"name", "blocked", "how"}], "escapee": pid}.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from worker_runtime import Reporter, WorkerContext

attacks: list[dict[str, Any]] = []


def attempt(name: str, action: Any) -> None:
    """Run one attack; it is blocked when it raises OSError (or returns a reason it failed)."""
    try:
        outcome = action()
    except OSError as exc:
        attacks.append({"name": name, "blocked": True, "how": type(exc).__name__})
        return
    blocked = isinstance(outcome, str) and outcome.startswith("blocked")
    attacks.append({"name": name, "blocked": blocked, "how": outcome if isinstance(outcome, str) else "got through"})


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args[:-1] else None


def my_agent() -> int:
    """The agent that started this worker: the first ancestor running `trainyard agent`."""
    pid = os.getpid()
    while pid > 1:
        pid = parent(pid)
        args = cmdline(pid)
        if "agent" in args and any("trainyard" in a or "node_agent" in a for a in args):
            return pid
    raise RuntimeError("no agent among this worker's ancestors")


def victim_torchrun(victim_job: str, agent: int) -> tuple[int, list[str]]:
    """The other job's torchrun on this node (started by the same agent): its pid and command line."""
    deadline = time.monotonic() + 60
    mine = os.environ.get("TRAINYARD_ATTEMPT_ID")
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            args = cmdline(int(entry.name))
            rdzv = flag(args, "--rdzv-id")
            if "node_agent.ranks.torchrun_entry" in args and rdzv and rdzv != mine:
                with contextlib.suppress(OSError, ValueError):
                    if parent(int(entry.name)) == agent:
                        return int(entry.name), args
        time.sleep(0.2)
    raise RuntimeError(f"the victim job {victim_job}'s torchrun never showed on this node")


def read(path: str) -> str:
    with open(path, "rb") as f:
        f.read(1)
    return "got through: read it"


def open_for_writing(path: str) -> str:
    os.close(os.open(path, os.O_WRONLY | os.O_APPEND))  # opened, not written: nothing changes either way
    return "got through: opened for writing"


def create(path: str) -> str:
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    os.unlink(path)  # it could be made: gone again, so that nothing changes either way
    return "got through: created"


def post_number(number: bytes) -> str:
    body = (b'{"fencing_token": "%s", "rank": 0, "step": 1, "loss": %s}'
            % (os.environ["TRAINYARD_FENCING_TOKEN"].encode(), number))
    path = f"/v1/local/attempts/{os.environ['TRAINYARD_ATTEMPT_ID']}/progress".encode()
    request = (b"POST " + path + b" HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body
    if os.environ.get("TRAINYARD_AGENT_SOCKET"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(os.environ["TRAINYARD_AGENT_SOCKET"])
    else:  # an agent serving TCP
        host, port = os.environ["TRAINYARD_AGENT_URL"].rsplit("/", 1)[-1].rsplit(":", 1)
        sock = socket.create_connection((host, int(port)))
    with sock:
        sock.settimeout(10)
        sock.sendall(request)
        answer = sock.recv(65536)
    status = int(answer.split(b" ", 2)[1])
    return f"blocked: HTTP {status}" if status == 422 else f"got through: HTTP {status}"


# --- issue 23, finding 5: a memory PUT flood against its own agent (self-contained) ---


def _vm_rss(pid: int) -> int:
    """The agent's resident memory in bytes (/proc/<pid>/status is readable by every uid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def flood_memory_tier(agent: int) -> str:
    """32 connections to its own agent's memory tier, each announcing a 4 GiB shard and sending 1 MiB
    of it: an agent that allocated the declared length (128 GiB) would die with every job on the
    node. Blocked when the agent's memory grows by less than 512 MiB and every connection is told
    no (413/503) or only waits for bytes that never come."""
    path = os.environ.get("TRAINYARD_AGENT_SOCKET")
    if not path:
        return "blocked: no local socket to flood"
    before = _vm_rss(agent)
    head = (f"PUT /v1/local/attempts/{os.environ['TRAINYARD_ATTEMPT_ID']}/memory/0/{'0' * 64} HTTP/1.1\r\n"
            f"Host: agent\r\nX-Trainyard-Fencing-Token: {os.environ['TRAINYARD_FENCING_TOKEN']}\r\n"
            f"Content-Length: {4 << 30}\r\n\r\n").encode()
    socks = []
    for _ in range(32):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(path)
        with contextlib.suppress(OSError):  # refused before the body: the agent closes at once
            sock.sendall(head + b"x" * (1 << 20))
        socks.append(sock)
    grown = 0
    for _ in range(5):  # the agent takes in what was sent: its peak while all 32 are open
        time.sleep(0.05)
        grown = max(grown, _vm_rss(agent) - before)
    answers: dict[str, int] = {}
    for sock in socks:
        sock.settimeout(0.1)
        try:
            got = sock.recv(64)
            status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "closed"
        except TimeoutError:
            status = "held"  # reserved, waiting for its body: it costs what it sent
        except OSError:
            status = "closed"
        answers[status] = answers.get(status, 0) + 1
        sock.close()
    stored = any(code.startswith("2") for code in answers)
    how = f"agent RSS +{grown >> 20} MiB, answers {answers}"
    return f"got through: {how}" if stored or grown >= 512 << 20 else f"blocked: {how}"


def escape() -> int:
    """A process in a session of its own with an empty environment: no marker left to find it by."""
    return subprocess.Popen(["/bin/sleep", "600"], env={}, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid


# --- issue 23, finding 3: shipped code (docs/security.md, "Shipped code") ---

VICTIM_CODE_FILE = "victim_code.py"
"""A file of the victim job's shipped code (tests/e2e/test_isolation.py ships it)."""


def read_existing(path: str) -> str:
    """``read``, except that a path that is not there proves nothing (the victim ships no code?)."""
    try:
        return read(path)
    except FileNotFoundError:
        return f"not tried: nothing at {path}"


def attack_shipped_code(work_dir: str, victim_worker_dir: str, victim_code_sha: str | None) -> None:
    """Every job's code archives sit in the node's cache, and each attempt's unpacked code in its
    worker directory: another tenant's worker must neither list nor read either."""
    attempt("list the node's code cache", lambda: str(os.listdir(f"{work_dir}/code")[:0]))
    attempt("read the other job's code archive in the node's cache",
            lambda: read_existing(f"{work_dir}/code/{victim_code_sha}.tar.gz") if victim_code_sha
            else "not tried: no hash given")
    attempt("read the other attempt's unpacked code",
            lambda: read_existing(f"{victim_worker_dir}/code/{VICTIM_CODE_FILE}"))
    attempt("list the node's venv cache (other tenants' requirements) or plant one",
            lambda: list_or_plant_envs(work_dir))


def list_or_plant_envs(work_dir: str) -> str:
    """The venvs of every tenant's requirements sit in WORK_DIR/envs (0711: runnable by key, not
    listable); where no job has built one yet, planting that directory would poison later builds."""
    try:
        return str(os.listdir(f"{work_dir}/envs")[:0])
    except FileNotFoundError:
        os.mkdir(f"{work_dir}/envs")
        return "got through: planted the venv cache"


# -- Storage grants (issue 23, finding 7): asked through the worker runtime's own client ----------
def storage_attacks(ctx: WorkerContext, victim_job: str) -> list[threading.Thread]:
    """Grants it should not get, and more bytes than granted: each must be refused by the control
    plane (GrantRefused) or by S3 (the signed Content-Length); anything else (a timeout, an agent
    that cannot answer) is recorded as not blocked, so it cannot pass for a refusal. They run at
    once, in threads, beside the other attacks (each is a round trip to the control plane: run one
    after another they made the hostile job outlast its victim); join the threads returned."""
    import urllib3

    from trainyard.protocol import keys
    from worker_runtime.checkpoint.presigned import AgentGrants, GrantRefused

    grants = AgentGrants(agent_url=ctx.agent_url, attempt_id=ctx.attempt_id, fencing_token=ctx.fencing_token,
                         rank=ctx.rank, agent_socket=ctx.agent_socket, wait_s=2)
    own = keys.job_checkpoint_prefix(ctx.job_id)

    def refused(key: str, size: int) -> Any:
        def ask() -> str:
            started = time.monotonic()
            try:
                grants.grants("PUT", key, size_bytes=size)
            except GrantRefused as exc:
                return f"blocked: HTTP {exc.status} in {time.monotonic() - started:.2f} s"
            except OSError as exc:
                return f"not refused: {type(exc).__name__} in {time.monotonic() - started:.2f} s"
            return "got through: granted"
        return ask

    def overfill() -> str:
        started = time.monotonic()
        [put] = grants.grants("PUT", keys.shard_key(own, 1, ctx.attempt_number, ctx.rank), size_bytes=8).grants
        body = b"\0" * 2**20
        headers = {**put.headers, "Content-Length": str(len(body))}  # 1 MiB, where 8 bytes were granted
        try:
            status = urllib3.PoolManager(retries=False, cert_reqs="CERT_NONE", timeout=10).request(
                "PUT", put.url, body=body, headers=headers).status
        except urllib3.exceptions.HTTPError as exc:  # S3 refused and closed before reading the body
            return f"blocked: {type(exc).__name__} in {time.monotonic() - started:.2f} s"
        took = f"in {time.monotonic() - started:.2f} s"
        return f"got through: S3 answered {status}" if status < 300 else f"blocked: S3 answered {status} {took}"

    tries: list[tuple[str, Any]] = [
        ("ask a storage grant for a far-future step",
         refused(keys.shard_key(own, 50_000_000, ctx.attempt_number, ctx.rank), 8)),
        ("ask a storage grant for a 300 GiB shard",
         refused(keys.shard_key(own, 1, ctx.attempt_number, ctx.rank), 300 * 2**30)),
        ("ask a storage grant for the other job's shard",
         refused(keys.shard_key(keys.job_checkpoint_prefix(victim_job), 1, 1, 0), 8)),
        ("write more bytes than its storage grant allows", overfill),
    ]
    threads = [threading.Thread(target=attempt, args=t) for t in tries]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    victim_job = sys.argv[1]
    ctx = WorkerContext.from_env()
    agent = my_agent()
    agent_args = cmdline(agent)
    victim_pid, victim_args = victim_torchrun(victim_job, agent)
    victim_attempt = flag(victim_args, "--rdzv-id") or "?"
    work_dir = flag(agent_args, "--work-dir") or "."
    victim_worker_dir = str(Path(flag(victim_args, "--log-dir") or ".").parent)
    storage = storage_attacks(ctx, victim_job)

    attempt("read /proc/1/environ", lambda: read("/proc/1/environ"))
    attempt("read the agent's environment", lambda: read(f"/proc/{agent}/environ"))
    attempt("find the join token on the agent's command line",
            lambda: "got through: on the command line" if "--join-token" in agent_args else "blocked: not there")
    join_file = flag(agent_args, "--join-token-file")
    attempt("read the agent's join token file",
            lambda: read(join_file) if join_file else "blocked: the agent has no join token file")
    attempt("read the agent's node credential", lambda: read(f"{work_dir}/node-credential"))
    attempt("find storage credentials in its own environment",
            lambda: "got through: a secret key" if any(k.endswith("SECRET_KEY") for k in os.environ)
            else "blocked: none")
    attempt("read the other attempt's environment (its fencing token)", lambda: read(f"/proc/{victim_pid}/environ"))
    attempt("list the agent's attempt directories", lambda: str(os.listdir(f"{work_dir}/attempts")[:0]))
    attempt("read the other attempt's state.json",
            lambda: read(f"{work_dir}/attempts/{victim_attempt}/state.json"))
    def write_rank_status() -> str:
        status = f"{victim_worker_dir}/status"
        names = [n for n in sorted(os.listdir(status)) if n.startswith("rank-")]
        return open_for_writing(f"{status}/{names[0]}") if names else "blocked: no rank file to write"

    attempt("write the other attempt's rank status", write_rank_status)
    attempt("add a rank status file to the other attempt", lambda: create(f"{victim_worker_dir}/status/rank-9.json"))
    attempt("read the other attempt's logs", lambda: str(os.listdir(f"{victim_worker_dir}/logs")[:0]))
    import node_agent.ranks.shim

    attempt("overwrite the rank shim every later job runs", lambda: open_for_writing(node_agent.ranks.shim.__file__))
    attempt("plant a module where later jobs import from",
            lambda: create(str(Path(node_agent.ranks.shim.__file__).with_name("hostile_plant.py"))))
    attempt("signal the other attempt's torchrun", lambda: os.kill(victim_pid, 0) or "got through: allowed")
    if os.environ.get("TRAINYARD_AGENT_SOCKET"):
        sockets = Path(os.environ["TRAINYARD_AGENT_SOCKET"]).parent
        victim_socket = str(sockets / f"{victim_attempt}.{flag(victim_args, '--node-rank')}.sock")

        def connect() -> str:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.connect(victim_socket)
            return "got through: connected"

        attempt("connect to the other attempt's local API", connect)
    attack_shipped_code(work_dir, victim_worker_dir, sys.argv[2] if len(sys.argv) > 2 else None)
    attempt("post a NaN progress report", lambda: post_number(b"NaN"))
    attempt("post an infinite progress report (1e999)", lambda: post_number(b"1e999"))
    attempt("flood its agent's memory tier with 32 PUTs announcing 4 GiB each", lambda: flood_memory_tier(agent))
    for thread in storage:
        thread.join()
    escapee = escape()
    print(json.dumps({"uid": os.getuid(), "attacks": attacks, "escapee": escapee}), flush=True)
    if ctx.is_main:
        with Reporter(ctx) as reporter:
            reporter.result({"uid": os.getuid(), "attacks": attacks, "escapee": escapee})


if __name__ == "__main__":
    main()
