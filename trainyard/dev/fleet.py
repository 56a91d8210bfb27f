"""Simulated node agents for scale runs: many agents in one process, speaking the real agent
protocol over HTTP (trainyard/protocol/agent.py) to a real control plane, with simulated workers
that upload small shards to a real S3 and report them.

Used by bench/scale.py (hundreds to thousands of agents, figures) and by the suite
(tests/e2e/test_scale.py: 64 agents, protocol properties, no timings). Nothing here imitates the
server: the control plane is a ``trainyard server`` subprocess on real PostgreSQL and S3.

A simulated agent does what the real one does on the wire and nothing else: it registers, sends a
heartbeat every interval listing the attempts its "processes" run and the specs it holds (or, in
``legacy`` mode, no ``known``, as an older agent), starts a simulated run for every new spec (a
status report with every worker running), stops what is no longer assigned (a final ``stopped``
report, then the attempt drops out of its heartbeats), and on request reports checkpoint shards or
a rank that exits with an error.

Checkpoints through the real protocol, per rank or per node, with presigned URLs: fleet_saves.py.
The fleet in a process of its own, driven over a pipe (bench/checkpoint_scale.py): fleet_proc.py.
``upload_shards`` and ``checkpoint`` below skip the slots and grants (S3 credentials, reports only).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from trainyard.cli.tls import client_context
from trainyard.dev.certs import ensure_server_tls
from trainyard.embedded import free_port
from trainyard.embedded.processes import stop_process_group
from trainyard.protocol.agent import AGENT_BACKOFF_S, AGENT_TRIES, agent_request_timeout_s
from trainyard.protocol.keys import job_checkpoint_prefix, shard_key

AGENT = "/v1/agent"


@dataclass(frozen=True)
class S3Target:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str

    def client(self) -> Any:
        from minio import Minio

        return Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False)


class Target(Protocol):
    """What the fleet needs of a control plane: where it listens (``urls``: every replica, the first
    being ``url``), the tokens, and the CA its HTTPS certificate is verified with (None: HTTP)."""

    @property
    def url(self) -> str: ...
    @property
    def urls(self) -> list[str]: ...
    @property
    def admin_token(self) -> str: ...
    @property
    def join_token(self) -> str: ...
    @property
    def ca_file(self) -> str | None: ...


def verify_for(target: Target) -> Any:
    """httpx's ``verify`` for ``target``: its CA over HTTPS, the default otherwise."""
    return client_context(target.ca_file) if target.ca_file else True


@dataclass
class Endpoints:
    """A Target by value (what a fleet in another process is given)."""

    urls: list[str]
    admin_token: str
    join_token: str
    ca_file: str | None = None

    @property
    def url(self) -> str:
        return self.urls[0]


class ControlPlane:
    """``trainyard server`` as a subprocess (its own process group) on the given database and S3;
    HTTPS, as in production, with a certificate made in ``tls_dir`` (trainyard/dev/certs.py)."""

    def __init__(self, database_url: str, s3: S3Target, *, admin_token: str, join_token: str,
                 log_path: Path, env: dict[str, str] | None = None, tls_dir: Path | None = None) -> None:
        self.port = free_port()
        self.tls = ensure_server_tls(tls_dir, ["127.0.0.1"]) if tls_dir is not None else None
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"
        self.ca_file = str(self.tls.ca_file) if self.tls else None
        self.admin_token, self.join_token = admin_token, join_token
        self.log_path = log_path
        self._env = {
            "TRAINYARD_DATABASE_URL": database_url,
            "TRAINYARD_ADMIN_TOKEN": admin_token,
            "TRAINYARD_JOIN_TOKEN": join_token,
            "TRAINYARD_S3_ENDPOINT": s3.endpoint,
            "TRAINYARD_S3_ACCESS_KEY": s3.access_key,
            "TRAINYARD_S3_SECRET_KEY": s3.secret_key,
            "TRAINYARD_S3_BUCKET": s3.bucket,
            "TRAINYARD_LOG_LEVEL": "warning",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def urls(self) -> list[str]:
        return [self.url]

    def set_env(self, **env: str) -> None:
        """Settings for the next ``start`` (a restart on the same port, database and S3)."""
        self._env.update(env)

    def start(self, timeout_s: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
        env.update(self._env)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainyard", "server", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "warning",
                 *(["--tls-cert", str(self.tls.cert_file), "--tls-key", str(self.tls.key_file)] if self.tls else [])],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the control plane exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2.0, verify=verify_for(self)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the control plane did not become ready in {timeout_s:g}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc, 10.0)
            self.proc = None


@dataclass
class SimRun:
    spec: dict[str, Any]
    alive: bool = True
    final_sent: bool = False

    @property
    def attempt_id(self) -> str:
        return str(self.spec["attempt_id"])

    def workers(self, state: str, exit_code: int | None = None, *, failed_local: int | None = None,
                failed_code: int = 1) -> list[dict[str, Any]]:
        base = self.spec["node_rank"] * self.spec["nproc_per_node"]
        out = []
        for i in range(self.spec["nproc_per_node"]):
            code = exit_code
            if failed_local is not None:
                code = failed_code if i == failed_local else -15
            out.append({"rank": base + i, "local_rank": i, "pid": 10_000 + base + i, "state": state, "exit_code": code})
        return out


@dataclass
class Sample:
    at: float
    latency_s: float
    size: int
    full_specs: int
    phase: str
    kind: str = "heartbeat"
    """heartbeat, or wait: a long poll's answer that carried the node's desired state (its latency
    is how long it was held open, not a figure)."""
    timed_out: bool = False
    """A heartbeat try that ran out of the agent's per-try timeout (its latency is that timeout)."""


class SimAgent:
    def __init__(self, fleet: Fleet, index: int, gpus: int) -> None:
        self.fleet = fleet
        self.index = index
        self.name = f"sim-{index:05d}"
        self.gpus = gpus
        self.address = f"127.1.{index // 250}.{index % 250 + 1}"
        self.instance = os.urandom(8).hex()
        self.token: str | None = None
        self.storage: dict[str, Any] = {}
        self.seq = 0
        self.legacy = False
        self.runs: dict[str, SimRun] = {}
        self.held: dict[str, str] = {}  # attempt id -> spec version
        self.arrivals: dict[str, float] = {}  # attempt id -> when its full spec first arrived
        self.arrived_by: dict[str, str] = {}  # attempt id -> "wait" or "heartbeat": the answer that brought it
        self.samples: list[Sample] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.interval_s = fleet.interval_s
        """What the control plane told this agent (``fleet.follow_interval``), else the fleet's."""
        self.woken = asyncio.Event()  # set by the long poll: heartbeat now
        self.beat = asyncio.Event()  # set after each answered heartbeat
        self.try_timeout_s: float | None = None
        """The real agent's per-try heartbeat timeout (``fleet.agent_timeouts``), from registration."""

    # Clients shared by a few agents each: one pool of thousands of connections costs the simulator
    # more CPU per request than the control plane spends answering it (httpcore). Each agent talks
    # to the replica the fleet routes it to (``Fleet.route``).
    @property
    def http(self) -> httpx.AsyncClient:
        return self.fleet.client(self.index, "requests")

    @property
    def wait_http(self) -> httpx.AsyncClient:
        return self.fleet.client(self.index, "waits")

    @property
    def heartbeat_http(self) -> httpx.AsyncClient:
        """The heartbeats' own connections, as the real agent's heartbeat loop has (a client of its
        thread): a heartbeat never waits for a connection behind the workers' requests."""
        return self.fleet.client(self.index, "heartbeats")

    @property
    def saves_http(self) -> httpx.AsyncClient:
        """The workers' checkpoint requests (the real agent relays them on pooled clients, one per
        request in flight)."""
        return self.fleet.client(self.index, "saves")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    async def register(self) -> None:
        body = {"name": self.name, "address": self.address, "agent_version": "sim",
                "gpus": [{"index": i, "uuid": f"virtual-{self.name}-{i}", "kind": "virtual-cpu", "memory_mb": 0}
                         for i in range(self.gpus)]}
        self.fleet.requests["register"] += 1
        r = await self.fleet.http.post(f"{AGENT}/register", json=body,
                                       headers={"Authorization": f"Bearer {self.fleet.cp.join_token}"})
        r.raise_for_status()
        reg = r.json()
        self.token, self.storage = reg["node_token"], reg.get("storage", {})
        if self.fleet.agent_timeouts:  # as node_agent/loops/heartbeat.py after registering
            self.try_timeout_s = agent_request_timeout_s(float(reg["heartbeat_interval_s"]),
                                                         float(reg["node_lost_timeout_s"]))
        if self.fleet.follow_interval:
            self.interval_s = float(reg.get("heartbeat_interval_s") or self.interval_s)

    async def heartbeat(self) -> dict[str, Any]:
        self.seq += 1
        body: dict[str, Any] = {"agent_instance": self.instance, "seq": self.seq,
                                "attempts": [{"attempt_id": a} for a, run in self.runs.items() if run.alive]}
        if not self.legacy:
            body["known"] = [{"attempt_id": a, "version": v} for a, v in self.held.items()]
        sent_at = time.monotonic()
        phase = self.fleet.phase  # the phase it was sent in: legacy-ness is decided at send time
        r, latency = await self._heartbeat_tries(body, phase)
        if r.status_code >= 500:
            self.fleet.server_errors.append(f"{self.name} heartbeat: HTTP {r.status_code}")
            return {}
        r.raise_for_status()
        resp: dict[str, Any] = r.json()
        self.samples.append(Sample(time.monotonic(), latency, len(r.content), len(resp["assignments"]), phase))
        if self.fleet.follow_interval:
            self.interval_s = float(resp.get("heartbeat_interval_s") or self.interval_s)
        self._reconcile(resp, sent_at, by="heartbeat")
        self.beat.set()
        return resp

    async def _heartbeat_tries(self, body: dict[str, Any], phase: str) -> tuple[httpx.Response, float]:
        """One heartbeat; with ``fleet.agent_timeouts`` as the real agent sends it (node_agent/link/client.py):
        up to AGENT_TRIES tries of ``try_timeout_s`` each, a jittered backoff between them. A try that
        times out is a sample of its own (``timed_out``) and counted in ``fleet.heartbeat_timeouts``."""
        tries = AGENT_TRIES if self.try_timeout_s is not None else 1
        timeout = self.try_timeout_s if self.try_timeout_s is not None else 60.0
        for attempt in range(tries):
            if attempt:
                await asyncio.sleep(AGENT_BACKOFF_S / 3 * attempt * random.uniform(0.5, 1.0))
            self.fleet.requests["heartbeat"] += 1
            t0 = time.perf_counter()
            try:
                r = await self.heartbeat_http.post(f"{AGENT}/heartbeat", json=body, headers=self._headers(),
                                                   timeout=httpx.Timeout(timeout, connect=min(timeout, 3.0)))
            except httpx.TimeoutException:
                if self.try_timeout_s is None or attempt == tries - 1:
                    raise
                self.fleet.heartbeat_timeouts += 1
                self.samples.append(Sample(time.monotonic(), time.perf_counter() - t0, 0, 0, phase, timed_out=True))
                continue
            return r, time.perf_counter() - t0
        raise AssertionError("unreachable")

    async def wait_loop(self, stop: asyncio.Event) -> None:
        """The real agent's long poll (node_agent/loops/desired.py, DesiredState.step): a 'changed' answer carries the
        node's desired state, applied at once (``fleet.wait_answers``; else it wakes the heartbeat
        loop, and the next wait starts once that heartbeat brought the new versions)."""
        await asyncio.sleep(random.uniform(0, 1.0))
        first = True  # agents registered together: their first waits end spread out, as if started apart
        while not stop.is_set():
            timeout = min(110.0, max(self.fleet.wait_timeout_s, 2 * self.interval_s))  # as the real agent
            timeout *= random.uniform(0.1, 1.0) if first else random.uniform(0.8, 1.0)
            first = False
            body = {"known": [{"attempt_id": a, "version": v} for a, v in self.held.items()], "timeout_s": timeout,
                    "answer": self.fleet.wait_answers and not self.legacy}
            sent_at = time.monotonic()
            self.fleet.requests["wait"] += 1
            try:
                r = await self.wait_http.post(f"{AGENT}/wait", json=body, headers=self._headers(),
                                              timeout=timeout + 30)
            except httpx.TransportError as exc:
                self.fleet.server_errors.append(f"{self.name} wait: {type(exc).__name__}")
                await asyncio.sleep(self.interval_s)
                continue
            self.fleet.waits += 1
            if r.status_code >= 500:
                if r.status_code != 503:
                    self.fleet.server_errors.append(f"{self.name} wait: HTTP {r.status_code}")
                await asyncio.sleep(self.interval_s * random.uniform(0.5, 1.0))
                continue
            if r.status_code >= 400:
                self.fleet.errors.append(f"{self.name} wait: HTTP {r.status_code} {r.text[:200]}")
                await asyncio.sleep(self.interval_s)
                continue
            answer = r.json()
            if answer["changed"] and answer.get("assignments") is not None:
                self.samples.append(Sample(time.monotonic(), 0.0, len(r.content), len(answer["assignments"]),
                                           self.fleet.phase, kind="wait"))
                self._reconcile({"assignments": answer["assignments"], "unchanged": answer.get("unchanged") or []},
                                sent_at, by="wait")
            elif answer["changed"]:
                self.beat.clear()
                self.woken.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.beat.wait(), self.interval_s + 5.0)

    def _reconcile(self, resp: dict[str, Any], sent_at: float, *, by: str) -> None:
        """As the real agent's: an answer to a request sent before a spec arrived (from the other
        loop) does not stop it by its silence."""
        full = resp["assignments"]
        assigned = {s["attempt_id"] for s in full}
        assigned |= {u["attempt_id"] for u in resp.get("unchanged", []) if u["desired"] == "run"}
        assigned |= {a for a, t in self.arrivals.items() if t > sent_at}
        self.held = {a: v for a, v in self.held.items() if a in assigned}
        for spec in full:
            attempt_id = spec["attempt_id"]
            self.held[attempt_id] = spec.get("version", "")
            if attempt_id not in self.runs:
                self.arrivals.setdefault(attempt_id, time.monotonic())
                self.arrived_by.setdefault(attempt_id, by)
                run = self.runs[attempt_id] = SimRun(spec)
                self._spawn(self.status(run, "running", workers=run.workers("running")))
        for run in list(self.runs.values()):
            if run.alive and run.attempt_id not in assigned:
                self._spawn(self.stop(run))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.fleet.errors.append(f"{self.name}: {task.exception()!r}")

    async def _post(self, path: str, body: dict[str, Any], *, timeout: float = 60.0,
                    kind: str | None = None, http: httpx.AsyncClient | None = None) -> httpx.Response:
        """POST with the real agent's persistence: 5xx and transport errors are retried (level-triggered
        reports make that safe) and counted in ``fleet.server_errors``; any other answer is returned."""
        for attempt in range(20):
            self.fleet.requests[kind or path.rsplit("/", 1)[-1]] += 1
            try:
                r = await (http or self.http).post(path, json=body, headers=self._headers(), timeout=timeout)
            except httpx.TransportError as exc:
                self.fleet.server_errors.append(f"{self.name} {path}: {type(exc).__name__}")
            else:
                if r.status_code < 500:
                    return r
                self.fleet.server_errors.append(f"{self.name} {path}: HTTP {r.status_code}")
            await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt) * random.uniform(0.5, 1.0))
        raise RuntimeError(f"{self.name}: {path} kept failing")

    async def status(self, run: SimRun, state: str, *, exit_code: int | None = None,
                     workers: list[dict[str, Any]]) -> dict[str, Any] | None:
        body = {"fencing_token": run.spec["fencing_token"], "node_rank": run.spec["node_rank"], "state": state,
                "exit_code": exit_code, "workers": workers}
        if state in ("exited", "stopped"):
            body["processes_alive"] = False  # as the real agent's final report: nothing of it is left
        r = await self._post(f"{AGENT}/attempts/{run.attempt_id}/status", body)
        if r.status_code == 409:  # fenced off: the real agent stops it
            run.alive = False
            return None
        r.raise_for_status()
        ack: dict[str, Any] = r.json()
        if ack["stop"] and run.alive and state not in ("exited", "stopped"):
            self._spawn(self.stop(run))
        return ack

    async def stop(self, run: SimRun) -> None:
        """The processes are stopped (at once, in a simulation): a final status, then gone."""
        if not run.alive:
            return
        run.alive = False
        ack = await self.status(run, "stopped", workers=run.workers("exited", -15))
        self._gone(ack)

    async def fail(self, run: SimRun, *, local_rank: int = 0, exit_code: int = 1) -> None:
        """One rank exits with ``exit_code``; torchrun stops the others and exits with 1."""
        run.alive = False
        ack = await self.status(run, "exited", exit_code=1,
                                workers=run.workers("exited", failed_local=local_rank, failed_code=exit_code))
        self._gone(ack)

    def _gone(self, ack: dict[str, Any] | None) -> None:
        """As the real agent once an attempt's last process is gone: its final report released the
        GPUs, or else (fenced off, an older control plane) a heartbeat at once confirms it."""
        if ack is None or not ack.get("released"):
            self.woken.set()

    async def report_shards(self, run: SimRun, shards: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"fencing_token": run.spec["fencing_token"], "node_rank": run.spec["node_rank"], "shards": shards}
        r = await self._post(f"{AGENT}/attempts/{run.attempt_id}/shards", body, timeout=120.0)
        if r.status_code >= 400:
            raise RuntimeError(f"{self.name}: shard report of node rank {run.spec['node_rank']}: "
                               f"HTTP {r.status_code} {r.text[:300]}")
        ack: dict[str, Any] = r.json()
        return ack

    async def loop(self, stop: asyncio.Event) -> None:
        await asyncio.sleep(random.uniform(0, self.interval_s))  # agents that start together spread out
        while not stop.is_set():
            started = time.monotonic()
            self.woken.clear()
            try:
                await self.heartbeat()
            except httpx.TimeoutException as exc:
                if self.try_timeout_s is None:
                    self.fleet.server_errors.append(f"{self.name} heartbeat: {type(exc).__name__}")
                    continue
                # Its last try ran out too (fleet.agent_timeouts): counted, and the loop goes on.
                self.fleet.heartbeat_timeouts += 1
                self.samples.append(Sample(time.monotonic(), self.try_timeout_s or 0.0, 0, 0, self.fleet.phase,
                                           timed_out=True))
                self.fleet.server_errors.append(f"{self.name} heartbeat: every try timed out")
            except httpx.TransportError as exc:
                self.fleet.server_errors.append(f"{self.name} heartbeat: {type(exc).__name__}")
            except httpx.HTTPError as exc:
                self.fleet.errors.append(f"{self.name}: {type(exc).__name__}: {exc}")
            # Jittered like the real agent's (node_agent/loops/desired.py HEARTBEAT_JITTER).
            period = self.interval_s * (random.uniform(0.8, 1.0) if self.fleet.follow_interval else 1.0)
            wait = max(0.0, period - (time.monotonic() - started))
            stopped, woken = asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.woken.wait())
            await asyncio.wait({stopped, woken}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            woken.cancel()


class Fleet:
    """N simulated agents on one shared HTTP client, heartbeating concurrently until ``close()``."""

    def __init__(self, cp: Target, s3: S3Target | None, *, gpus_per_node: int = 8, interval_s: float = 1.0,
                 follow_interval: bool = True, long_poll: bool = True, wait_timeout_s: float = 25.0,
                 agent_timeouts: bool = False) -> None:
        """``follow_interval``: each agent heartbeats at the interval the control plane tells it
        (it grows with the fleet), else every ``interval_s``; ``long_poll``: each agent keeps a
        ``POST /v1/agent/wait`` open and heartbeats when it returns 'changed'. Both off: the
        protocol before the long poll (a fixed interval). ``agent_timeouts``: heartbeats time out
        and are tried again as the real agent's (else they wait up to 60 s). ``s3``: credentials for
        ``upload_shards`` only (the protocol's checkpoints, trainyard/dev/fleet_saves.py, use
        presigned URLs and need none)."""
        self.cp, self.s3 = cp, s3
        self.verify = verify_for(cp)
        self.agent_timeouts = agent_timeouts
        self.requests: Counter[str] = Counter()
        """Requests sent to the control plane, by kind (heartbeat, wait, status, shards, ...; the
        admin API's are not counted)."""
        self.heartbeat_timeouts = 0
        """Heartbeat tries that ran out of the agent's per-try timeout (``agent_timeouts``)."""
        self.replicas = 1
        """Agent i talks to replica ``i % replicas`` of ``cp.urls`` (``route``)."""
        self.gpus_per_node = gpus_per_node
        self.interval_s = interval_s
        self.follow_interval = follow_interval
        self.long_poll = long_poll
        self.wait_timeout_s = wait_timeout_s
        self.wait_answers = True
        """Long polls ask for the desired state with a change (WaitRequest.answer), as the real agent."""
        self.waits = 0
        """Long polls answered."""
        self.http = httpx.AsyncClient(base_url=cp.url, timeout=60.0, verify=self.verify,
                                      limits=httpx.Limits(max_connections=4000, max_keepalive_connections=4000))
        self._clients: dict[tuple[int, str, str], httpx.AsyncClient] = {}
        self.admin = {"Authorization": f"Bearer {cp.admin_token}"}
        self.agents: list[SimAgent] = []
        self.phase = "start"
        self.errors: list[str] = []
        """Protocol errors (4xx, bad answers): none is expected."""
        self.server_errors: list[str] = []
        """5xx answers and broken connections (the agents retry, as the real one does)."""
        self._stop = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._pool = ThreadPoolExecutor(16)
        self._s3: Any = None

    AGENTS_PER_CLIENT = 32

    def client(self, index: int, kind: str) -> httpx.AsyncClient:
        url = self.cp.urls[index % max(1, min(self.replicas, len(self.cp.urls)))]
        key = (index // self.AGENTS_PER_CLIENT, kind, url)
        if key not in self._clients:
            most = self.AGENTS_PER_CLIENT * (2 * self.gpus_per_node if kind == "saves" else 2)
            self._clients[key] = httpx.AsyncClient(base_url=url, timeout=60.0, verify=self.verify, limits=httpx.Limits(
                max_connections=most, max_keepalive_connections=most))
        return self._clients[key]

    def route(self, replicas: int) -> None:
        """From now on agent i talks to replica ``i % replicas`` (they share one database, so any
        replica serves any agent); long polls already open end on their own."""
        self.replicas = max(1, min(replicas, len(self.cp.urls)))

    async def grow(self, n: int) -> None:
        """Register agents up to ``n`` in all and start their heartbeat loops."""
        new = [SimAgent(self, i, self.gpus_per_node) for i in range(len(self.agents), n)]
        for chunk in range(0, len(new), 50):
            await asyncio.gather(*(a.register() for a in new[chunk:chunk + 50]))
        self.agents += new
        self._loops += [asyncio.ensure_future(a.loop(self._stop)) for a in new]
        if self.long_poll:
            self._loops += [asyncio.ensure_future(a.wait_loop(self._stop)) for a in new]

    def longest_interval(self) -> float:
        return max([a.interval_s for a in self.agents] or [self.interval_s])

    async def close(self) -> None:
        self._stop.set()
        for task in self._loops:  # an in-flight heartbeat may wait for its timeout: don't
            task.cancel()
        for agent in self.agents:
            for pending in list(agent._tasks):
                pending.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self.http.aclose()
        for client in self._clients.values():
            await client.aclose()
        self._pool.shutdown(wait=False)

    async def measure(self, phase: str, seconds: float, *, each_of: Sequence[SimAgent] = (),
                      timeout_s: float = 120.0) -> list[Sample]:
        """Tag heartbeats with ``phase`` for ``seconds``, and on until each agent of ``each_of`` has
        sent one in it: a fixed window shorter than a loaded machine's heartbeat period can hold
        no heartbeat of a given node at all (seen in make test under load)."""
        self.phase = phase
        await asyncio.sleep(seconds)
        deadline = time.monotonic() + timeout_s
        while any(not any(s.phase == phase for s in a.samples) for a in each_of):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat of every node in phase {phase} within {timeout_s:g}s")
            await asyncio.sleep(0.05)
        self.phase = "between"
        return [s for a in self.agents for s in a.samples if s.phase == phase and s.kind == "heartbeat"]

    # -- admin API ---------------------------------------------------------------------------------

    async def submit(self, name: str, num_nodes: int, *, args_size: int = 0, max_failures: int = 3) -> dict[str, Any]:
        body = {"name": name, "num_nodes": num_nodes, "gpus_per_node": self.gpus_per_node,
                "entrypoint": "bench.simulated", "args": ["--steps", "1000", "--pad", "x" * args_size],
                "checkpoint": {"interval_steps": 100}, "max_failures": max_failures}
        r = await self.http.post("/v1/jobs", json=body, headers=self.admin)
        assert r.status_code == 201, r.text
        job: dict[str, Any] = r.json()
        return job

    async def job(self, job_id: str) -> dict[str, Any]:
        r = await self.http.get(f"/v1/jobs/{job_id}", headers=self.admin)
        r.raise_for_status()
        job: dict[str, Any] = r.json()
        return job

    async def cancel(self, job_id: str) -> None:
        (await self.http.post(f"/v1/jobs/{job_id}/cancel", headers=self.admin)).raise_for_status()

    # -- what the agents hold ------------------------------------------------------------------------

    def parts(self, job_id: str, attempt_number: int) -> list[tuple[SimAgent, SimRun]]:
        return [(a, run) for a in self.agents for run in a.runs.values()
                if run.spec["job_id"] == job_id and run.spec["attempt_number"] == attempt_number]

    async def wait_parts(self, job_id: str, attempt_number: int, num_nodes: int,
                         timeout_s: float = 120.0) -> list[tuple[SimAgent, SimRun]]:
        return await wait_until(lambda: (p if len(p := self.parts(job_id, attempt_number)) == num_nodes else None),
                                timeout_s, f"{num_nodes} nodes hold attempt {attempt_number} of job {job_id}")

    # -- checkpoints and failures --------------------------------------------------------------------

    def _upload(self, key: str, data: bytes) -> None:
        s3 = self.s3
        assert s3 is not None, "upload_shards needs the fleet's S3 credentials"
        if self._s3 is None:
            self._s3 = s3.client()
        self._s3.put_object(s3.bucket, key, io.BytesIO(data), len(data))

    async def upload_shards(self, parts: list[tuple[SimAgent, SimRun]], step: int,
                            size: int = 256) -> dict[str, list[dict[str, Any]]]:
        """Every rank uploads a small shard of ``step`` to S3; returns each attempt part's ShardInfos."""
        loop = asyncio.get_running_loop()
        uploads, shards = [], {}
        for agent, run in parts:
            spec = run.spec
            world = spec["nnodes"] * spec["nproc_per_node"]
            infos = []
            for local in range(spec["nproc_per_node"]):
                rank = spec["node_rank"] * spec["nproc_per_node"] + local
                data = f"{spec['attempt_id']}:{step}:{rank}:".encode().ljust(size, b".")
                key = shard_key(job_checkpoint_prefix(spec["job_id"]), step, spec["attempt_number"], rank)
                uploads.append(loop.run_in_executor(self._pool, self._upload, key, data))
                infos.append({"rank": rank, "step": step, "world_size": world, "key": key, "size_bytes": len(data),
                              "sha256": hashlib.sha256(data).hexdigest()})
            shards[agent.name] = infos
        await asyncio.gather(*uploads)
        return shards

    async def checkpoint(self, parts: list[tuple[SimAgent, SimRun]], step: int) -> float:
        """Upload every rank's shard, then every node reports its shards at once; returns the seconds
        from the first report sent to the acknowledgement that committed the step."""
        shards = await self.upload_shards(parts, step)
        t0 = time.perf_counter()
        acks = await asyncio.gather(*(agent.report_shards(run, shards[agent.name]) for agent, run in parts))
        if any(step in ack["committed_steps"] for ack in acks):
            return time.perf_counter() - t0
        # Committed by the maintenance loop rather than by the last report (e.g. S3 was slow).
        job_id = parts[0][1].spec["job_id"]

        async def committed() -> bool | None:
            r = await self.http.get(f"/v1/jobs/{job_id}/checkpoints", headers=self.admin)
            return True if any(c["step"] == step and c["state"] == "committed" for c in r.json()["items"]) else None

        await wait_until(committed, 60.0, f"step {step} of job {job_id} committed")
        return time.perf_counter() - t0

    async def fail_and_recover(self, parts: list[tuple[SimAgent, SimRun]], num_nodes: int,
                               timeout_s: float = 120.0) -> tuple[float, float, list[tuple[SimAgent, SimRun]]]:
        """Node rank 1 (or 0) reports a rank exiting with code 1; returns the seconds from that report
        to the first node and to every node holding the next attempt, and the new attempt's parts."""
        agent, run = sorted(parts, key=lambda p: p[1].spec["node_rank"])[min(1, len(parts) - 1)]
        job_id, number = run.spec["job_id"], run.spec["attempt_number"]
        t0 = time.monotonic()
        await agent.fail(run)
        new = await self.wait_parts(job_id, number + 1, num_nodes, timeout_s)
        arrivals = [a.arrivals[r.attempt_id] for a, r in new]
        return min(arrivals) - t0, max(arrivals) - t0, new


async def wait_until(check: Callable[[], Any], timeout_s: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g}s waiting until {what}")
        await asyncio.sleep(every)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class JobFigures:
    ranks: int
    first_bytes: int = 0
    """Largest answer to a node (a long poll's, or a heartbeat's) that carried the job's new spec."""
    steady_bytes: int = 0
    """Largest heartbeat response of a node of the job once it holds the spec (delta protocol)."""
    legacy_steady_bytes: int = 0
    """The same with no `known` (an old agent: the full spec every heartbeat)."""
    commit_s: float = 0.0
    recovery_first_s: float = 0.0
    recovery_all_s: float = 0.0
    recovered_first_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _sizes(agents: list[SimAgent], since: float, *, full: bool, phase: str | None = None) -> list[int]:
    return [s.size for a in agents for s in a.samples
            if s.at >= since and (s.full_specs > 0) == full and (phase is None or s.phase == phase)]


def _latencies(agents: list[SimAgent], phase: str) -> list[float]:
    return [s.latency_s for a in agents for s in a.samples if s.phase == phase and s.kind == "heartbeat"]


async def job_scenario(fleet: Fleet, ranks: int, *, window_s: float = 3.0, args_size: int = 0,
                       say: Callable[[str], None] = lambda _: None) -> JobFigures:
    """One job of ``ranks`` ranks through the protocol: assigned, steady heartbeats (delta, then
    legacy full specs as the baseline), one checkpoint committed, one rank failure, the recovery
    attempt assigned to every node, then cancelled and released."""
    num_nodes = ranks // fleet.gpus_per_node
    figures = JobFigures(ranks)
    t_submit = time.monotonic()
    job = await fleet.submit(f"sim-{ranks}", num_nodes, args_size=args_size)
    parts = await fleet.wait_parts(job["id"], 1, num_nodes)
    say(f"{ranks} ranks: attempt 1 held by {num_nodes} nodes")
    agents = [a for a, _ in parts]
    await asyncio.sleep(fleet.longest_interval() * 1.5)  # every node has sent a heartbeat with `known` since
    figures.first_bytes = max(_sizes(agents, t_submit, full=True), default=0)
    await fleet.measure(f"steady-{ranks}", window_s, each_of=agents)
    figures.steady_bytes = max(_sizes(agents, t_submit, full=False, phase=f"steady-{ranks}"), default=0)
    figures.extra["steady_full_specs"] = sum(s.full_specs for a in agents for s in a.samples
                                             if s.phase == f"steady-{ranks}")
    for a in agents:
        a.legacy = True
    await fleet.measure(f"legacy-{ranks}", window_s, each_of=agents)
    for a in agents:
        a.legacy = False
    figures.legacy_steady_bytes = max(_sizes(agents, t_submit, full=True, phase=f"legacy-{ranks}"), default=0)
    for phase in (f"steady-{ranks}", f"legacy-{ranks}"):
        lat = _latencies(agents, phase)
        figures.extra[phase] = (percentile(lat, 50), percentile(lat, 99), len(lat))
    fleet.phase = f"checkpoint-{ranks}"  # heartbeats of every agent while the shards are uploaded and reported
    figures.commit_s = await fleet.checkpoint(parts, 100)
    fleet.phase = "between"
    lat = _latencies(fleet.agents, f"checkpoint-{ranks}")
    figures.extra["checkpoint_hb"] = (percentile(lat, 50), percentile(lat, 99), len(lat))
    say(f"{ranks} ranks: checkpoint of {ranks} shards committed in {figures.commit_s:.2f}s")
    t_fail = time.monotonic()
    figures.recovery_first_s, figures.recovery_all_s, new = await fleet.fail_and_recover(parts, num_nodes)
    say(f"{ranks} ranks: attempt 2 held by every node {figures.recovery_all_s:.2f}s after the failure report")
    figures.extra["recovered_attempt"] = new[0][1].spec["attempt_number"]
    figures.extra["recovered_nodes"] = len(new)
    figures.extra["restore_from"] = new[0][1].spec.get("restore_from")
    await asyncio.sleep(fleet.longest_interval() * 1.5)
    figures.recovered_first_bytes = max(_sizes([a for a, _ in new], t_fail, full=True), default=0)
    await fleet.cancel(job["id"])
    ours = {r.attempt_id for _, r in parts} | {r.attempt_id for _, r in new}

    async def released() -> bool | None:
        j = await fleet.job(job["id"])
        # Also until no agent holds one of its specs any more (an answer said 'stop'): an agent told
        # to stop by a status ack learns it from its next answer, and a stop reference left in the
        # next job's first answer would count against that job's figures (first_bytes).
        return True if j["state"] in ("cancelled", "failed", "succeeded") and not j["allocation"] \
            and not any(ours & a.held.keys() for a in fleet.agents) else None

    await wait_until(released, 120.0, f"job {job['id']} ended and released", every=0.25)
    return figures
