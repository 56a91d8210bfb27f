"""torchrun as the agent starts it:

    python -m node_agent.ranks.torchrun_entry [--wait-for HOST:PORT --wait-s SECONDS] -- TORCHRUN_ARGS...

It is ``python -m torch.distributed.run TORCHRUN_ARGS...`` with one difference: given
``--wait-for`` (the launcher passes node rank 0's static rendezvous endpoint to every other node
rank), it waits for that endpoint to accept a connection before torchrun creates its TCPStore
client, in a thread, while torch imports (about a second: the wait usually costs nothing). Without
it, a node whose torchrun finished importing before node rank 0's had started listening met
torch's connect backoff and joined up to a second after the host was up
(trainyard/protocol/rendezvous.py). The wait is bounded by ``--wait-s`` (the rendezvous's join
timeout); past it torchrun connects, and fails, as it would have. The wait counts against that
timeout: torchrun's own rendezvous gets only what is left of it (``--rdzv-conf timeout=``), so a
host that never listens is noticed after one join timeout (plus at most MIN_RDZV_TIMEOUT_S), not two.

Warm start. With TRAINYARD_STANDBY_DIR set (the agent keeps warm standbys: node_agent/ranks/standby.py)
this process first offers itself to a standby, exactly as a rank shim offers a rank: the standby
takes on this process's confinement (cgroup, uid, mount namespace) and forks torchrun from an
interpreter that has torch imported, so a new attempt's torchrun does not pay for its imports
(about a second). This process then stays as torchrun's stand-in for the agent, which started it
and knows its pid: it waits for the forked torchrun and exits as it did (the same status, or the
same signal). It writes the pids of the standby and of the forked torchrun to
``$TRAINYARD_STATUS_DIR/launcher.json`` so that the agent counts them as torchrun's own (a stopped
part whose ranks are gone has its torchrun killed at once). It ignores the stop signals: a stop
reaches every process of the attempt at once (the agent signals its cgroup or uid), torchrun
included; if this process is killed, the standby kills the forked torchrun. No standby warm, or one
that declines: the cold start below, in this process.

This module imports only the standard library before torch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NoReturn

from node_agent.ranks.entry_points import TORCHRUN_ENTRY
from node_agent.ranks.standby_claim import claim
from trainyard.protocol.env import ENV_STANDBY_DIR, ENV_STATUS_DIR
from trainyard.protocol.rendezvous import split_endpoint, wait_for_listener

USAGE = "usage: python -m node_agent.ranks.torchrun_entry [--wait-for HOST:PORT --wait-s SECONDS] -- TORCHRUN_ARGS..."
IN_STANDBY = "--in-standby"
"""Prepended to the arguments a standby runs this module with: it is the warm torchrun, it claims nothing."""
LAUNCHER_FILE = "launcher.json"
"""In the attempt's status directory: ``{"launcher", "standby", "torchrun"}`` pids of a warm start."""
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _parse(argv: list[str]) -> tuple[tuple[str, int] | None, float, list[str]]:
    if "--" not in argv:
        raise SystemExit(USAGE)
    split = argv.index("--")
    own, rest = argv[:split], argv[split + 1:]
    endpoint: tuple[str, int] | None = None
    wait_s = 300.0
    while own:
        flag, value, own = own[0], own[1] if len(own) > 1 else None, own[2:]
        try:
            if flag == "--wait-for" and value is not None:
                endpoint = split_endpoint(value)
            elif flag == "--wait-s" and value is not None:
                wait_s = float(value)
            else:
                raise ValueError(flag)
        except ValueError:
            raise SystemExit(USAGE) from None
    return endpoint, wait_s, rest


MIN_RDZV_TIMEOUT_S = 30


def with_timeout_left(rest: list[str], left_s: float) -> list[str]:
    """``rest`` with the ``timeout=`` of its ``--rdzv-conf`` lowered to ``left_s``, but never below
    MIN_RDZV_TIMEOUT_S: the static rendezvous's store keeps that timeout for its later operations."""
    out = list(rest)
    for i, arg in enumerate(out[:-1]):
        if arg == "--rdzv-conf":
            pairs = [p for p in out[i + 1].split(",") if p and not p.startswith("timeout=")]
            out[i + 1] = ",".join([*pairs, f"timeout={max(MIN_RDZV_TIMEOUT_S, int(left_s))}"])
            break  # torchrun's own (the launcher's, before the script); the script's args are its own
    return out


def _start_warm(argv: list[str]) -> None:
    """Hand torchrun to a warm standby and stand in for it until it exits; return if none takes it."""
    directory = os.environ.get(ENV_STANDBY_DIR)
    if not directory:
        return
    # A stop that arrives during the claim is kept and handed on (to the forked torchrun, or to this
    # process when it starts cold); once torchrun runs, a stop reaches it directly (the cgroup).
    early: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _frame: early.append(signum)) for sig in _STOP_SIGNALS}
    worker, why = claim(Path(directory), "module", TORCHRUN_ENTRY, [IN_STANDBY, *argv], dict(os.environ),
                        cwd=os.getcwd(), stdio=[1, 2])
    if worker is None:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        print(f"torchrun_entry: starts cold: {why}", file=sys.stderr, flush=True)
        for signum in early:
            os.kill(os.getpid(), signum)
        return
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for signum in early:
        worker.send_signal(signum)
    status_dir = os.environ.get(ENV_STATUS_DIR)
    if status_dir:
        record = {"launcher": os.getpid(), "standby": worker.standby_pid, "torchrun": worker.pid}
        tmp = Path(status_dir) / f".{LAUNCHER_FILE}.{os.getpid()}.tmp"
        try:
            tmp.write_text(json.dumps(record))
            tmp.replace(Path(status_dir) / LAUNCHER_FILE)
        except OSError as exc:
            print(f"torchrun_entry: cannot record the warm torchrun: {exc}", file=sys.stderr, flush=True)
    print(f"torchrun_entry: torchrun runs warm as pid {worker.pid}", file=sys.stderr, flush=True)
    code = worker.wait()
    if code < 0:
        sys.stderr.flush()
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [IN_STANDBY]:
        args = args[1:]
    else:
        _start_warm(args)
    endpoint, wait_s, rest = _parse(args)
    waiter: threading.Thread | None = None
    outcome: list[int | None] = []
    started = time.monotonic()
    if endpoint is not None:
        waiter = threading.Thread(target=lambda: outcome.append(wait_for_listener(*endpoint, wait_s)),
                                  name="rendezvous-wait", daemon=True)
        waiter.start()
    from torch.distributed import run  # noqa: PLC0415 - imported while the wait runs

    if waiter is not None and endpoint is not None:
        waiter.join(max(0.0, started + wait_s - time.monotonic()))
        refused = outcome[0] if outcome else None
        host, port = endpoint
        said = "did not accept within the join timeout" if refused is None else \
            f"accepted after {refused} refused tries"
        # torchrun's stderr is the attempt's torchrun.stderr.log (not shipped to the user).
        print(f"torchrun_entry: rendezvous host {host}:{port} {said} "
              f"({time.monotonic() - started:.2f} s after start, torch imported)", file=sys.stderr, flush=True)
        rest = with_timeout_left(rest, started + wait_s - time.monotonic())
    sys.argv = ["torchrun", *rest]
    run.main(rest)
    sys.exit(0)


if __name__ == "__main__":
    main()
