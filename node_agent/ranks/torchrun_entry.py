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

This module imports only the standard library before torch.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import NoReturn

from trainyard.protocol.rendezvous import split_endpoint, wait_for_listener

USAGE = "usage: python -m node_agent.ranks.torchrun_entry [--wait-for HOST:PORT --wait-s SECONDS] -- TORCHRUN_ARGS..."


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


def main(argv: list[str] | None = None) -> NoReturn:
    endpoint, wait_s, rest = _parse(sys.argv[1:] if argv is None else argv)
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
