"""In-process restart, worker side only: failure -> first step of the next attempt, with and without it.

    .venv/bin/python bench/inproc_restart.py [--repeat 3] [--kill-at-step 4]

Two ranks of a small DDP model (gloo, CPU) over a fenced rendezvous (worker_runtime.run_restartable),
with a stand-in for the node agents' local API in this process (it accepts every report and answers
``next-assignment``). Rank 1 is SIGKILLed once rank 0 reported ``--kill-at-step``; then, measured
from the kill to the next attempt's first progress report:

- **in-process**: rank 0 is handed its part of the next attempt and restarts in its process; only
  rank 1 starts anew (a fresh interpreter, torch imports, rendezvous);
- **cold**: rank 0 is told ``stop`` and exits; once it is gone both ranks of the next attempt start
  anew (what the agents do today, without the control plane's part of it).

No control plane, no checkpoint storage (both restart from step 0): this isolates what keeping the
healthy process saves; bench/recovery.py measures whole recoveries. The ratio is in-process / cold
(below 1: in-process is faster), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainyard.embedded import free_port  # noqa: E402
from trainyard.protocol import env as penv  # noqa: E402
from trainyard.protocol.restart import Assignment, NextAssignmentAnswer, Rendezvous  # noqa: E402

STEPS = 10_000  # never reached: the bench stops the workers once it measured


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a killed worker's connection reset mid-request: expected here


class Agent:
    """The local API of both ranks' agents: records the first progress of each attempt, answers
    ``next-assignment`` with what ``handover`` holds for the token (else ``waiting``)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.progress: dict[tuple[str, int], float] = {}  # (attempt, rank) -> first report's arrival
        self.steps: dict[str, int] = {}
        self.handover: dict[str, dict[str, Any]] = {}
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        agent = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                parts = self.path.split("?")[0].split("/")
                attempt, kind = parts[-2], parts[-1]
                answer: dict[str, Any] = {"accepted": True}
                with agent.cond:
                    if kind == "progress":
                        agent.progress.setdefault((attempt, int(body.get("rank", 0))), time.monotonic())
                        agent.steps[attempt] = max(agent.steps.get(attempt, 0), int(body.get("step", 0)))
                        agent.cond.notify_all()
                    elif kind == "next-assignment":
                        answer = agent.handover.get(body.get("fencing_token", ""), {"state": "waiting"})
                if kind == "next-assignment" and answer.get("state") == "waiting":
                    time.sleep(0.02)
                raw = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        return Handler

    def wait(self, predicate: Any, timeout: float = 120.0) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise TimeoutError("the workers did not report in time")


def _env(agent: Agent, attempt: int, rank: int, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "MASTER_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    env.update({penv.ENV_JOB_ID: "bench", penv.ENV_ATTEMPT_ID: f"att-{attempt}", penv.ENV_ATTEMPT_NUMBER: str(attempt),
                penv.ENV_FENCING_TOKEN: f"tok-{attempt}", penv.ENV_NODE_RANK: str(rank), penv.ENV_DEVICE: "cpu",
                penv.ENV_AGENT_URL: agent.url,
                penv.ENV_RENDEZVOUS: Rendezvous(host="127.0.0.1", port=port).to_env()})
    return env


def _spawn(agent: Agent, attempt: int, rank: int, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker"], cwd=ROOT,
                            env=_env(agent, attempt, rank, port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_run(mode: str, kill_at: int) -> float:
    agent = Agent()
    port0, port1 = free_port(), free_port()
    procs = [_spawn(agent, 0, r, port0) for r in (0, 1)]
    try:
        agent.wait(lambda: agent.steps.get("att-0", 0) >= kill_at)
        killed = time.monotonic()
        procs[1].send_signal(signal.SIGKILL)
        if mode == "in-process":
            assignment = Assignment(attempt_id="att-1", attempt_number=1, fencing_token="tok-1", rank=0,
                                    world_size=2, node_rank=0, rendezvous=Rendezvous(host="127.0.0.1", port=port1))
            with agent.cond:
                agent.handover["tok-0"] = NextAssignmentAnswer(state="assigned", assignment=assignment).model_dump()
            procs.append(_spawn(agent, 1, 1, port1))
        else:
            with agent.cond:
                agent.handover["tok-0"] = {"state": "stop"}
            procs[0].wait(timeout=120)  # the agent confirms the survivor gone before the next attempt
            procs += [_spawn(agent, 1, r, port1) for r in (0, 1)]
        agent.wait(lambda: ("att-1", 0) in agent.progress and ("att-1", 1) in agent.progress)
        return max(agent.progress[("att-1", 0)], agent.progress[("att-1", 1)]) - killed
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        agent.server.shutdown()


def worker() -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F
    from torch.utils.data import TensorDataset

    from worker_runtime import run_restartable

    def train(loop: Any) -> None:
        torch.manual_seed(0)
        x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(7))
        data = TensorDataset(x, x.sum(dim=1, keepdim=True))
        model = loop.register("model", nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
        optimizer = loop.register("optimizer", torch.optim.SGD(model.parameters(), lr=0.01))
        net = loop.ddp(model)
        for _, (xb, yb) in loop.steps(loop.data_loader(data, batch_size=16)):
            loss = F.mse_loss(net(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loop.log(loss=loss)
            time.sleep(0.05)

    run_restartable(train, total_steps=STEPS, log_every=1, timeout_s=30.0, handover_wait_s=60.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kill-at-step", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker()
        return
    times: dict[str, list[float]] = {"cold": [], "in-process": []}
    for _ in range(args.repeat):
        for mode in times:  # alternated, so that load on the machine hits both alike
            times[mode].append(one_run(mode, args.kill_at_step))
    cold = statistics.median(times["cold"])
    print(f"failure -> first step of the next attempt, 2 ranks (gloo), {args.repeat} run(s) each, median s")
    print(f"{'mode':<12} {'median_s':>9} {'min_s':>7} {'max_s':>7} {'ratio':>6}")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"{mode:<12} {median:>9.2f} {min(values):>7.2f} {max(values):>7.2f} {median / cold:>6.2f}")


if __name__ == "__main__":
    main()
