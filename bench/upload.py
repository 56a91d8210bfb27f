"""Checkpoint uploads on a shared link: N ranks checkpoint at once, with and without upload slots.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/upload.py [--ranks 16] [--nodes 4] [--shard-mb 4]
                                                                      [--link-mb-s 24]

Real parts: embedded PostgreSQL and S3 (SeaweedFS), a ``trainyard server`` subprocess, and per
simulated node the agent's own local API, slot relay and shard relay (node_agent/local/api.py,
link/upload_slots.py, link/relay.py) registered with the control plane as a node (labels ``rack=r1``,
``rack=r2``: the first half of the nodes, then the second). Each rank is a thread running the worker
runtime's CheckpointManager (slot wait, paced upload, shard report) on a TrainState of
``--shard-mb``; every rank saves the same step at once. The shared link is a TCP proxy in front
of S3 that forwards at most ``--link-mb-s`` MB/s in all (what all the nodes' uploads share, a rack
uplink say). A foreground transfer (another client putting 1 MB objects through the same proxy, in
a loop) measures what the link leaves to other traffic while the burst runs; its rate alone is
measured first, in the same run.

Configurations (the control plane is restarted with each): no limits; one upload per rack at a time
(TRAINYARD_UPLOAD_SLOTS_PER_LABEL=1); and that plus a byte budget per node of a quarter of the link
(TRAINYARD_UPLOAD_NODE_RATE_BYTES_PER_S). Printed: the burst's total time, the peak of uploads in
flight per rack (counted at the storage calls), each rank's slot wait (p50 / max), the mean upload
time, the foreground transfer's rate during the burst against alone, and what the control plane
recorded for the checkpoint (GET /v1/jobs/{id}/checkpoints: its longest wait and its upload rate).
"""

from __future__ import annotations

import argparse
import resource
import secrets
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.shared_link import ThrottledProxy  # noqa: E402

MB = 1_000_000


def say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Flight:
    """Uploads in flight per rack, counted around the storage calls; the peaks reached."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    now: Counter[str] = field(default_factory=Counter)
    peak: Counter[str] = field(default_factory=Counter)

    def enter(self, rack: str) -> None:
        with self.lock:
            self.now[rack] += 1
            self.peak[rack] = max(self.peak[rack], self.now[rack])

    def leave(self, rack: str) -> None:
        with self.lock:
            self.now[rack] -= 1


class CountedStorage:
    """A worker's real storage (presigned URLs through its agent, sent through the link), counting
    its uploads in flight per rack."""

    def __init__(self, inner: Any, rack: str, flight: Flight) -> None:
        self.inner, self.rack, self.flight = inner, rack, flight

    def put_object(self, key: str, data: Any, *, length: int | None = None) -> Any:
        self.flight.enter(self.rack)
        try:
            return self.inner.put_object(key, data, length=length)
        finally:
            self.flight.leave(self.rack)

    def put_object_paced(self, key: str, data: Any, *, length: int, pace: Any) -> Any:
        self.flight.enter(self.rack)
        try:
            return self.inner.put_object_paced(key, data, length=length, pace=pace)
        finally:
            self.flight.leave(self.rack)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Foreground:
    """Puts 1 MB objects through the link in a loop; its rate over a window."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        self.sent: list[tuple[float, int]] = []  # (end time, bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="foreground")

    def _run(self) -> None:
        import io

        payload = secrets.token_bytes(MB)
        i = 0
        while not self._stop.is_set():
            self.storage.put_object(f"foreground/{i % 8}", io.BytesIO(payload), length=len(payload))
            self.sent.append((time.monotonic(), len(payload)))
            i += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def rate(self, start: float, end: float) -> float:
        done = sum(n for t, n in self.sent if start < t <= end)
        return done / max(1e-9, end - start)


@dataclass
class Outcome:
    name: str
    total_s: float
    peak: dict[str, int]
    waits: list[float]
    uploads: list[float]
    slots: Counter[str]
    fg_rate: float
    recorded: dict[str, Any] | None


def run_config(name: str, env: dict[str, str], args: argparse.Namespace, ctx: dict[str, Any], round_: int) -> Outcome:
    import httpx
    import torch

    from node_agent.link.client import ControlPlaneClient
    from node_agent.link.relay import Outbox, Relay
    from node_agent.link.upload_slots import SlotRelay
    from node_agent.local.api import BASE_URL, LocalApi
    from trainyard.dev.fleet import ControlPlane
    from trainyard.protocol.agent import (
        AttemptStatusReport,
        HeartbeatRequest,
        LaunchSpec,
        RegisterRequest,
        WorkerStatus,
    )
    from trainyard.protocol.grants import StorageRequest
    from trainyard.storage.s3 import S3Config, S3Storage
    from worker_runtime import CheckpointManager, WorkerContext
    from worker_runtime.checkpoint.notify import CheckpointReporter
    from worker_runtime.checkpoint.presigned import AgentGrants, PresignedStorage
    from worker_runtime.state import TrainState

    s3, link = ctx["s3"], ctx["link"]
    cp = ControlPlane(ctx["pg_url"], s3, admin_token="bench-admin", join_token="bench-join",
                      log_path=ctx["data"] / f"control-plane-{round_}.log", env={
                          "TRAINYARD_NODE_LOST_TIMEOUT_S": "300", "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "900",
                          "TRAINYARD_CHECKPOINT_PENDING_TIMEOUT_S": "1800",
                          # Workers' presigned URLs name the link, so their uploads go through it.
                          "TRAINYARD_S3_WORKER_ENDPOINT": link.endpoint, **env})
    cp.start()
    apis: list[Any] = []
    clients: list[Any] = []
    stop = threading.Event()
    relays: list[threading.Thread] = []
    admin = httpx.Client(base_url=cp.url, headers={"Authorization": "Bearer bench-admin"}, timeout=60)
    sockets = tempfile.TemporaryDirectory(prefix="tyu-", dir="/tmp")  # a socket path holds 107 bytes
    try:
        gpus = args.ranks // args.nodes
        racks = ["r1" if n < args.nodes // 2 else "r2" for n in range(args.nodes)]
        for n in range(args.nodes):
            client = ControlPlaneClient(cp.url, join_token="bench-join")
            name_ = f"r{round_}-node-{n}"
            client.register(RegisterRequest.model_validate({
                "name": name_, "address": "127.0.0.1", "labels": {"rack": racks[n]},
                "gpus": [{"index": i, "uuid": f"{name_}-{i}", "kind": "virtual-cpu", "memory_mb": 0}
                         for i in range(gpus)]}))
            clients.append(client)
        r = admin.post("/v1/jobs", json={"name": f"upload-{round_}", "num_nodes": args.nodes, "gpus_per_node": gpus,
                                         "entrypoint": "bench", "checkpoint": {"interval_steps": 1}})
        r.raise_for_status()
        job_id = r.json()["id"]
        specs: list[LaunchSpec] = []
        deadline = time.monotonic() + 60
        while len(specs) < args.nodes:
            assert time.monotonic() < deadline, "the job was not placed"
            specs = [a for c in clients for a in c.heartbeat(HeartbeatRequest(agent_instance="bench", seq=int(
                time.monotonic() * 1000))).assignments if a.job_id == job_id]
            time.sleep(0.2)
        nodes = []
        for client, spec, rack in zip(clients, specs, racks, strict=True):
            workers = [WorkerStatus(rank=spec.node_rank * gpus + i, local_rank=i, state="running") for i in range(gpus)]
            client.report_status(spec.attempt_id, AttemptStatusReport(
                fencing_token=spec.fencing_token, node_rank=spec.node_rank, state="running", workers=workers))
            outbox = Outbox()

            def target(attempt_id: str, t: tuple[str, int] = (spec.fencing_token, spec.node_rank)) -> tuple[str, int]:
                return t

            relay = Relay(outbox, client, target=target, on_stale=lambda a, e: None, on_unauthorized=lambda: None)
            slots = SlotRelay(client, target=target, on_stale=lambda a, e: None, on_unauthorized=lambda: None)
            def grants(attempt_id: str, body: Any, client: Any = client, node_rank: int = spec.node_rank) -> Any:
                granted = client.storage_grants(attempt_id, StorageRequest(**body.model_dump(), node_rank=node_rank))
                return HTTPStatus.OK, granted.model_dump(mode="json")  # a failure fails the bench, loudly

            api = LocalApi(outbox=outbox, slots=slots, grants=grants)
            api.reports.register(spec.attempt_id, spec.fencing_token)
            # Each node's part of the attempt has its own socket, as under an agent (TRAINYARD_AGENT_SOCKET).
            api.open(spec.attempt_id, Path(sockets.name) / f"{spec.node_rank}.sock")
            apis.append(api)

            def relay_loop(relay: Relay = relay, outbox: Outbox = outbox) -> None:
                while not stop.is_set():
                    outbox.wait(relay.step())

            t = threading.Thread(target=relay_loop, daemon=True)
            t.start()
            relays.append(t)
            nodes.append((spec, api, rack))

        flight = Flight()
        storage_cfg = S3Config(endpoint=link.endpoint, bucket=s3.bucket, access_key=s3.access_key,
                               secret_key=s3.secret_key)
        managers = []
        for spec, api, rack in nodes:
            for i in range(gpus):
                rank = spec.node_rank * gpus + i
                wctx = WorkerContext(job_id=job_id, attempt_id=spec.attempt_id, attempt_number=spec.attempt_number,
                                     fencing_token=spec.fencing_token, rank=rank, world_size=args.ranks,
                                     agent_url=BASE_URL, agent_socket=str(api.socket_of(spec.attempt_id)),
                                     checkpoint={"interval_steps": 1},
                                     checkpoint_prefix=spec.storage.get("prefix") or None)
                state = TrainState()
                torch.manual_seed(rank)
                state.register("blob", torch.nn.Embedding(int(args.shard_mb * MB) // 4000, 1000))
                source = AgentGrants(agent_url=BASE_URL, attempt_id=spec.attempt_id,
                                     fencing_token=spec.fencing_token, rank=rank, agent_socket=wctx.agent_socket)
                store = CountedStorage(PresignedStorage(source, timeout_s=120, retries=0), rack, flight)
                managers.append(CheckpointManager(wctx, state, storage=store, reporter=CheckpointReporter(wctx),
                                                  interval_steps=1))
        fg = Foreground(S3Storage(storage_cfg, timeout_s=120, retries=0))
        fg.start()
        time.sleep(2.0)  # the foreground transfer settles before the burst
        barrier = threading.Barrier(len(managers) + 1)

        def rank_save(m: Any) -> None:
            barrier.wait()
            m.save(1)
            m.wait()

        threads = [threading.Thread(target=rank_save, args=(m,), daemon=True) for m in managers]
        for t in threads:
            t.start()
        barrier.wait()
        started = time.monotonic()
        for t in threads:
            t.join(900)
        total = time.monotonic() - started
        fg.stop()
        records = [m.saves[-1] for m in managers]
        assert all(r.ok for r in records), [r.error for r in records if not r.ok]
        ckpt = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ckpts = admin.get(f"/v1/jobs/{job_id}/checkpoints").json()["items"]
            if ckpts and ckpts[0]["state"] == "committed":
                ckpt = ckpts[0]
                break
            time.sleep(0.2)
        for m in managers:
            m.close()
        return Outcome(name=name, total_s=total, peak=dict(flight.peak), waits=[r.slot_wait_s for r in records],
                       uploads=[r.upload_s for r in records], slots=Counter(r.slot for r in records),
                       fg_rate=fg.rate(started, started + total), recorded=ckpt and ckpt["upload"])
    finally:
        stop.set()
        for api in apis:
            api.outbox.close()
            api.stop()
        for client in clients:
            client.close()
        admin.close()
        cp.stop()
        sockets.cleanup()


@dataclass
class ScaleOutcome:
    ranks: int
    total_s: float
    ideal_s: float
    peak: int
    peak_label: int
    waits: list[float]
    requests: int
    latencies: list[float]
    transactions: int
    client_cpu_s: float
    server_cpu_s: float


async def _scale(cp: Any, args: argparse.Namespace, per_node: int, racks: int,
                 transactions: Any) -> tuple[list[float], int, list[float], float, str, int]:
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(base_url=cp.url, timeout=120, limits=limits) as http:
        nodes = args.scale_ranks // per_node
        tokens = []
        for n in range(nodes):
            r = await http.post("/v1/agent/register", headers={"Authorization": "Bearer bench-join"}, json={
                "name": f"scale-{n:04d}", "address": "127.0.0.1", "labels": {"rack": f"r{n % racks}"},
                "gpus": [{"index": i, "uuid": f"scale-{n}-{i}", "kind": "virtual-cpu", "memory_mb": 0}
                         for i in range(per_node)]})
            r.raise_for_status()
            tokens.append({"Authorization": f"Bearer {r.json()['node_token']}"})
        admin = {"Authorization": "Bearer bench-admin"}
        r = await http.post("/v1/jobs", headers=admin, json={"name": "scale", "num_nodes": nodes,
                                                             "gpus_per_node": per_node, "entrypoint": "bench"})
        r.raise_for_status()
        job_id = r.json()["id"]
        specs: list[tuple[dict[str, Any], dict[str, str]]] = []  # each node's launch spec and its credential
        for _ in range(600):
            answers = await asyncio.gather(*[http.post("/v1/agent/heartbeat", headers=t, json={
                "agent_instance": "bench", "seq": int(time.time() * 1000), "attempts": []}) for t in tokens])
            specs = [(a.json()["assignments"][0], t) for a, t in zip(answers, tokens, strict=True)
                     if a.json()["assignments"]]
            if len(specs) == nodes:
                break
            await asyncio.sleep(0.2)
        assert len(specs) == nodes, "the scale job was not placed"
        waits: list[float] = []
        latencies: list[float] = []
        requests = 0
        start = asyncio.Event()

        async def post(url: str, auth: dict[str, str], body: dict[str, Any]) -> httpx.Response:
            # A kept-alive connection the server closes as it idles out is lost under the request
            # (ReadError); slot requests and releases may be repeated, as agents repeat them.
            for _ in range(4):
                try:
                    return await http.post(url, headers=auth, json=body)
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            return await http.post(url, headers=auth, json=body)

        async def rank(spec: dict[str, Any], auth: dict[str, str], local: int) -> None:
            nonlocal requests
            body = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"],
                    "rank": spec["node_rank"] * per_node + local, "step": 1, "size_bytes": 1, "wait_s": 20.0}
            url = f"/v1/agent/attempts/{spec['attempt_id']}/upload-slots"
            await start.wait()
            t0 = time.monotonic()
            while True:
                t = time.monotonic()
                r = await post(url, auth, body)
                requests += 1
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("Retry-After", "1")))
                    continue
                r.raise_for_status()
                if r.json()["state"] == "granted":
                    if t - t0 < 0.001:
                        latencies.append(time.monotonic() - t)
                    break
            waits.append(time.monotonic() - t0)
            await asyncio.sleep(args.scale_hold_s)  # the upload
            r = await post(url + "/release", auth, {
                key: body[key] for key in ("fencing_token", "node_rank", "rank", "step")})
            requests += 1
            r.raise_for_status()

        # Node ranks follow the topology (racks), not the order of registration: each node asks with
        # its own credential for its own block of ranks.
        tasks = [asyncio.create_task(rank(spec, auth, local)) for spec, auth in specs for local in range(per_node)]
        await asyncio.sleep(2.0)  # the statistics of what came before are flushed
        before = transactions()
        t0 = time.monotonic()
        start.set()
        await asyncio.gather(*tasks)
        total = time.monotonic() - t0
        await asyncio.sleep(2.0)
        return waits, requests, latencies, total, job_id, transactions() - before


def protocol_at_scale(args: argparse.Namespace, ctx: dict[str, Any]) -> ScaleOutcome:
    """``--scale-ranks`` ranks on nodes of 8 in 8 racks ask the control plane for a slot at once, over
    HTTP (the agent API, without agents or S3): each holds its slot ``--scale-hold-s`` (its upload),
    then releases it. Within cluster / per-rack limits of ``--scale-limit`` / ``--scale-limit`` / 4."""
    import asyncio
    from datetime import datetime

    import httpx
    import psycopg

    from trainyard.dev.fleet import ControlPlane

    per_node, racks = 8, 8
    cp = ControlPlane(ctx["pg_url"], ctx["s3"], admin_token="bench-admin", join_token="bench-join",
                      log_path=ctx["data"] / "control-plane-scale.log", env={
                          "TRAINYARD_NODE_LOST_TIMEOUT_S": "300", "TRAINYARD_ATTEMPT_LAUNCH_TIMEOUT_S": "900",
                          "TRAINYARD_CHECKPOINT_PENDING_TIMEOUT_S": "1800",
                          "TRAINYARD_UPLOAD_SLOTS_MAX": str(args.scale_limit),
                          "TRAINYARD_UPLOAD_SLOTS_PER_LABEL": str(max(1, args.scale_limit // 4))})
    cp.start()
    cpu = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    dsn = ctx["pg_url"].replace("postgresql+psycopg://", "postgresql://", 1)
    stats = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            def transactions() -> int:
                conn.execute("SELECT pg_stat_clear_snapshot()")
                return int(conn.execute(stats).fetchone()[0])  # type: ignore[index]

            waits, requests, latencies, total, job_id, count = asyncio.run(
                _scale(cp, args, per_node, racks, transactions))
        slots = httpx.get(f"{cp.url}/v1/upload-slots", params={"job_id": job_id},
                          headers={"Authorization": "Bearer bench-admin"}, timeout=60).json()["slots"]
    finally:
        cp.stop()  # waited for: its CPU time is counted in RUSAGE_CHILDREN
    end = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    client_cpu, server_cpu = (e.ru_utime + e.ru_stime - b.ru_utime - b.ru_stime for b, e in zip(cpu, end, strict=True))
    edges = []
    for slot in slots:
        if slot["granted_at"] is None:  # a wait that expired unanswered (its rank asked again, anew)
            continue
        edges += [(datetime.fromisoformat(slot["granted_at"]), 1, slot["label"]),
                  (datetime.fromisoformat(slot["ended_at"]), -1, slot["label"])]
    held: Counter[str] = Counter()
    peak = peak_label = 0
    for _, delta, label in sorted(edges, key=lambda e: (e[0], e[1])):
        held[label] += delta
        peak = max(peak, sum(held.values()))
        peak_label = max(peak_label, held[label])
    rounds = -(-args.scale_ranks // min(args.scale_limit, racks * max(1, args.scale_limit // 4)))
    return ScaleOutcome(ranks=args.scale_ranks, total_s=total, ideal_s=rounds * args.scale_hold_s, peak=peak,
                        peak_label=peak_label, waits=waits, requests=requests, latencies=latencies,
                        transactions=count, client_cpu_s=client_cpu, server_cpu_s=server_cpu)


def foreground_alone(ctx: dict[str, Any], seconds: float = 4.0) -> float:
    from trainyard.storage.s3 import S3Config, S3Storage

    s3, link = ctx["s3"], ctx["link"]
    fg = Foreground(S3Storage(S3Config(endpoint=link.endpoint, bucket=s3.bucket, access_key=s3.access_key,
                                       secret_key=s3.secret_key), timeout_s=120, retries=0))
    fg.start()
    time.sleep(1.0)
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    fg.stop()
    return fg.rate(start, end)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--nodes", type=int, default=4, help="nodes; the first half in rack r1, the rest in r2")
    parser.add_argument("--shard-mb", type=float, default=4.0, help="bytes each rank uploads, in MB")
    parser.add_argument("--link-mb-s", type=float, default=24.0, help="the shared link's rate, MB/s in all")
    parser.add_argument("--scale-ranks", type=int, default=1024,
                        help="ranks of the protocol-at-scale part (8 per node, 8 racks); 0: skip it")
    parser.add_argument("--scale-limit", type=int, default=64, help="its cluster-wide limit (per rack: a quarter)")
    parser.add_argument("--scale-hold-s", type=float, default=0.25, help="how long each of its ranks holds a slot")
    parser.add_argument("--scale-only", action="store_true", help="only the protocol-at-scale part")
    parser.add_argument("--data-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.ranks % args.nodes or args.nodes < 2:
        parser.error("--ranks must be a multiple of --nodes, and --nodes at least 2")

    from control_plane.db import run_migrations
    from trainyard.dev.fleet import S3Target
    from trainyard.embedded import EmbeddedPostgres, EmbeddedS3

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    link_rate = int(args.link_mb_s * MB)
    budget = link_rate // 4
    configs = [
        ("no limits", {}),
        ("1 upload per rack", {"TRAINYARD_UPLOAD_SLOTS_PER_LABEL": "1"}),
        (f"1 per rack + {budget / MB:g} MB/s per node", {"TRAINYARD_UPLOAD_SLOTS_PER_LABEL": "1",
                                                         "TRAINYARD_UPLOAD_NODE_RATE_BYTES_PER_S": str(budget)}),
    ]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="trainyard-upload-") as tmp:
        data = args.data_dir or Path(tmp)
        say(f"starting PostgreSQL and S3 in {data}")
        pg = EmbeddedPostgres(data / "postgres", database="trainyard")
        s3_server = EmbeddedS3(data / "s3", access_key="bench", secret_key=secrets.token_urlsafe(16),
                               bucket="trainyard", log_path=data / "s3.log")
        link = ThrottledProxy(s3_server.endpoint, rate_bytes_per_s=link_rate)
        try:
            run_migrations(pg.url)
            ctx = {"pg_url": pg.url, "s3": S3Target(s3_server.endpoint, "bench", s3_server.secret_key, "trainyard"),
                   "link": link, "data": data}
            alone = 0.0 if args.scale_only else foreground_alone(ctx)
            if not args.scale_only:
                say(f"foreground transfer alone: {alone / MB:.1f} MB/s through a {args.link_mb_s:g} MB/s link")
            for i, (name, env) in enumerate([] if args.scale_only else configs):
                say(f"{name}: {args.ranks} ranks x {args.shard_mb:g} MB on {args.nodes} nodes, 2 racks")
                outcomes.append(run_config(name, env, args, ctx, i))
                o = outcomes[-1]
                say(f"{name}: {o.total_s:.2f} s, peak per rack {o.peak}, foreground {o.fg_rate / MB:.1f} MB/s")
            scale = None
            if args.scale_ranks:
                say(f"protocol at scale: {args.scale_ranks} ranks ask at once, limit {args.scale_limit}")
                scale = protocol_at_scale(args, ctx)
        finally:
            link.close()
            s3_server.stop()
            pg.stop()

    if outcomes:
        base = outcomes[0]
        print()
        print(f"{args.ranks} ranks x {args.shard_mb:g} MB checkpointing at once, {args.nodes} nodes in 2 racks, "
              f"through a {args.link_mb_s:g} MB/s shared link; foreground transfer alone: {alone / MB:.1f} MB/s")
        print()
        print("| | total | vs no limits | peak uploads r1 / r2 | slot wait p50 / max | upload mean | "
              "foreground during burst | vs alone | recorded wait max / rate |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for o in outcomes:
            rec = o.recorded or {}
            rate = rec.get("bytes_per_s")
            print(f"| {o.name} | {o.total_s:.2f} s | {o.total_s / base.total_s:.2f} | "
                  f"{o.peak.get('r1', 0)} / {o.peak.get('r2', 0)} | "
                  f"{statistics.median(o.waits):.2f} / {max(o.waits):.2f} s | {statistics.mean(o.uploads):.2f} s | "
                  f"{o.fg_rate / MB:.1f} MB/s | {o.fg_rate / alone:.2f} | "
                  f"{rec.get('wait_s_max', 0):.2f} s / {(rate or 0) / MB:.1f} MB/s |")
        print()
        print("peak uploads: the most uploads in flight at once per rack, counted at the storage calls; slot")
        print("wait: each rank's wait for its upload slot; upload mean: the upload itself; foreground: the rate")
        print("of a 1 MB-object transfer through the same link while the burst ran; recorded: what")
        print("GET /v1/jobs/{id}/checkpoints shows for the checkpoint. slots used: "
              + "; ".join(f"{o.name}: {dict(o.slots)}" for o in outcomes))
    if scale is not None:
        per_rack = max(1, args.scale_limit // 4)
        print()
        print(f"Protocol at scale: {scale.ranks} ranks (8 per node, 8 racks) ask at once over HTTP, limits "
              f"{args.scale_limit} in the cluster / {per_rack} per rack, each holds its slot {args.scale_hold_s:g} s")
        print()
        print("| all served | ideal | peak granted (cluster / rack) | wait p50 / p99 / max | requests per rank | "
              "immediate grant p50 / p99 | database transactions per rank | CPU per rank: control plane / client |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        lat = sorted(scale.latencies) or [0.0]
        waits = sorted(scale.waits)
        print(f"| {scale.total_s:.2f} s | {scale.ideal_s:.2f} s | {scale.peak} / {scale.peak_label} | "
              f"{waits[len(waits) // 2]:.2f} / {waits[int(len(waits) * 0.99)]:.2f} / {waits[-1]:.2f} s | "
              f"{scale.requests / scale.ranks:.2f} | {lat[len(lat) // 2] * 1000:.0f} / "
              f"{lat[int(len(lat) * 0.99)] * 1000:.0f} ms | {scale.transactions / scale.ranks:.1f} | "
              f"{scale.server_cpu_s / scale.ranks * 1000:.0f} / {scale.client_cpu_s / scale.ranks * 1000:.0f} ms |")
        print()
        print("ideal: rounds of the limit x the hold time; requests per rank: slot requests (long polls,")
        print("re-asked when one ends) and the release; immediate grant: the latency of a first request")
        print("answered granted; transactions: the database's commits and rollbacks during the run / ranks;")
        print("CPU: the control plane's process (start to stop) and this script's (its HTTP client), per rank.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
