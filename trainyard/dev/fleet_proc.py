"""The simulated fleet (trainyard/dev/fleet.py) in a process of its own, so that its CPU is not the
benchmark's and can be measured apart (/proc/<pid>/stat of ``FleetProcess.pid``).

``python -m trainyard.dev.fleet_proc`` reads JSON lines on stdin and answers each with one JSON line
on stdout (``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``); the agents heartbeat and keep
their long polls between commands. The first line is the fleet's configuration (``FleetProcess``
writes it). Commands, ``{"op": ..., ...}``:

- ``grow`` ``n``: register agents up to ``n`` and start their loops; ``route`` ``replicas``;
- ``interval``: the longest heartbeat interval an agent was told;
- ``job`` ``name``, ``nodes``: submit a job of every GPU of ``nodes`` nodes, answered once every
  node holds attempt 1 (``job_id``);
- ``checkpoint`` ``job_id``, ``attempt``, ``step``, ``mode`` (rank | node), ``phase``: every rank
  saves a tiny shard through the protocol (trainyard/dev/fleet_saves.py); heartbeats sent meanwhile
  are tagged ``phase``. Answers the figures, or ``unavailable`` when the control plane lacks the
  per-node batch endpoints;
- ``phase`` ``name``: tag the heartbeats sent from now on;
- ``fail`` ``job_id``, ``attempt``, ``nodes``: a rank exits with code 1; answered once every node holds
  the next attempt (``first_s``, ``all_s`` after the report);
- ``cancel`` ``job_id``; ``requests``: the requests sent so far, by kind; ``samples``: every
  heartbeat try so far, the fleet's event-loop lags, request counts and errors;
- ``close``: the fleet stops and the process exits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from trainyard.dev.fleet import Endpoints, Fleet, percentile
from trainyard.dev.fleet_saves import BatchUnavailable, checkpoint
from trainyard.embedded.processes import stop_process_group


class FleetProcess:
    """A ``python -m trainyard.dev.fleet_proc`` child (its own process group) and its command pipe."""

    def __init__(self, endpoints: Endpoints, *, log_path: Path, gpus_per_node: int = 8,
                 agent_timeouts: bool = True) -> None:
        self.config = {"urls": endpoints.urls, "admin_token": endpoints.admin_token,
                       "join_token": endpoints.join_token, "ca_file": endpoints.ca_file,
                       "gpus_per_node": gpus_per_node, "agent_timeouts": agent_timeouts}
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "trainyard.dev.fleet_proc"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     start_new_session=True)
        self._send(self.config)

    def _send(self, message: dict[str, Any]) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one command and wait for its answer; RuntimeError if it failed."""
        assert self.proc is not None and self.proc.stdout is not None
        self._send({"op": op, **args})
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fleet process exited ({self.proc.poll()}) during {op!r}; log: {self.log_path}")
        answer: dict[str, Any] = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"fleet {op!r} failed: {answer.get('error')}; log: {self.log_path}")
        return answer

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                # Not call(): a command still in flight (an interrupted bench) would hold the answer back.
                with contextlib.suppress(OSError, ValueError):
                    self._send({"op": "close"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10.0)
            stop_process_group(self.proc, 5.0)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class _Runner:
    def __init__(self, config: dict[str, Any]) -> None:
        target = Endpoints(list(config["urls"]), config["admin_token"], config["join_token"], config.get("ca_file"))
        self.fleet = Fleet(target, None, gpus_per_node=int(config.get("gpus_per_node", 8)),
                           agent_timeouts=bool(config.get("agent_timeouts", True)))
        self.lags: list[tuple[str, float]] = []
        """(phase, seconds) the fleet's event loop was late by, sampled every 0.1 s: a fleet that
        cannot keep up measures its own delay, not the control plane's."""

    async def watch_lag(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(0.1)
            self.lags.append((self.fleet.phase, time.monotonic() - t0 - 0.1))

    async def handle(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        fleet = self.fleet
        if op == "grow":
            await fleet.grow(int(args["n"]))
            return {"agents": len(fleet.agents)}
        if op == "route":
            fleet.route(int(args["replicas"]))
            return {"replicas": fleet.replicas}
        if op == "requests":
            return {"requests": dict(fleet.requests)}
        if op == "interval":
            return {"interval_s": fleet.longest_interval()}
        if op == "phase":
            fleet.phase = str(args["name"])
            return {}
        if op == "job":
            job = await fleet.submit(str(args["name"]), int(args["nodes"]),
                                     max_failures=int(args.get("max_failures", 3)))
            await fleet.wait_parts(job["id"], 1, int(args["nodes"]))
            return {"job_id": job["id"]}
        if op == "checkpoint":
            parts = fleet.parts(str(args["job_id"]), int(args["attempt"]))
            previous, fleet.phase = fleet.phase, str(args.get("phase", fleet.phase))
            try:
                figures = await checkpoint(fleet, parts, int(args["step"]), mode=str(args.get("mode", "rank")))
            except BatchUnavailable as exc:
                return {"unavailable": str(exc)}
            finally:
                fleet.phase = previous
            return figures.as_dict()
        if op == "fail":
            job_id, attempt, nodes = str(args["job_id"]), int(args["attempt"]), int(args["nodes"])
            t0, errors_before = time.monotonic(), len(fleet.server_errors)
            first, every, new = await fleet.fail_and_recover(fleet.parts(job_id, attempt), nodes)
            seconds = sorted(a.arrivals[r.attempt_id] - t0 for a, r in new)
            by_heartbeat = sum(1 for a, r in new if a.arrived_by.get(r.attempt_id) == "heartbeat")
            # What the fleet retried meanwhile, by request and answer ("sim-00012 wait: HTTP 503" -> "wait: HTTP 503").
            retried = collections.Counter(e.split(" ", 1)[-1].rsplit("/", 1)[-1]
                                          for e in fleet.server_errors[errors_before:])
            return {"first_s": first, "all_s": every, "p50_s": percentile(seconds, 50),
                    "p90_s": percentile(seconds, 90), "by_heartbeat": by_heartbeat,
                    "retried": dict(retried.most_common(4))}
        if op == "cancel":
            await fleet.cancel(str(args["job_id"]))
            return {}
        if op == "samples":
            return {"heartbeats": [[s.phase, s.latency_s, s.timed_out, s.at] for a in fleet.agents for s in a.samples
                                   if s.kind == "heartbeat"],
                    "loop_lags": [[phase, lag] for phase, lag in self.lags if lag > 0.05],
                    "loop_lag_samples": len(self.lags),
                    "requests": dict(fleet.requests), "heartbeat_timeouts": fleet.heartbeat_timeouts,
                    "errors": fleet.errors[:20], "error_count": len(fleet.errors),
                    "server_errors": fleet.server_errors[:20], "server_error_count": len(fleet.server_errors)}
        raise ValueError(f"unknown op {op!r}")


async def _serve() -> None:
    loop = asyncio.get_running_loop()

    async def read() -> dict[str, Any] | None:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        return json.loads(line) if line.strip() else None

    def answer(payload: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(payload) + "\n")
        sys.stdout.flush()

    config = await read()
    if config is None:
        return
    runner = _Runner(config)
    watching = asyncio.ensure_future(runner.watch_lag())
    try:
        while (message := await read()) is not None:
            op = str(message.pop("op", ""))
            if op == "close":
                answer({"ok": True})
                break
            try:
                answer({"ok": True, **await runner.handle(op, message)})
            except Exception as exc:  # one failed command is the bench's to report; the fleet goes on
                answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    finally:
        watching.cancel()
        await runner.fleet.close()


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    asyncio.run(_serve())


if __name__ == "__main__":
    main()
