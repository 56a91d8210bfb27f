"""Checkpoints of the simulated fleet (trainyard/dev/fleet.py) through the real protocol: what a
node's workers and its agent send the control plane to save one step, with presigned URLs (no
storage credential in the fleet).

Two protocols, ``mode``:

- ``rank``: what node_agent and worker_runtime do today, per rank (worker_runtime/checkpoint/
  manager.py ``_upload``): an upload-slot long poll (``.../upload-slots``, asked again while
  ``waiting``), a create-only PUT grant (``.../storage``), the PUT to the presigned URL with its
  signed headers (``If-None-Match: *``), the shard queued in the node's relay (sent as it comes, in
  batches of up to 100: node_agent/link/relay.py), then the slot released (``.../upload-slots/release``).
- ``node``: the per-node batch protocol (issue 27): one ``.../upload-slots/batch`` for the node's
  ranks (asked again for those still waiting, releases riding along), one ``.../storage/batch``
  for the granted ranks, their PUTs, one shard report, and a last batch with the releases. A control
  plane without these endpoints answers 404: BatchUnavailable.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from trainyard.protocol.keys import job_checkpoint_prefix, shard_key

if TYPE_CHECKING:
    from trainyard.dev.fleet import Fleet, SimAgent, SimRun

AGENT = "/v1/agent"
SLOT_WAIT_S = 20.0
"""The long poll a worker asks for (worker_runtime/checkpoint/slots.py poll_s)."""
RELAY_BATCH = 100
"""Shards per relayed report at most (node_agent/link/outbox.py)."""
MODES = ("rank", "node")


class BatchUnavailable(RuntimeError):
    """The control plane has no per-node batch endpoints (they are answered 404 or 405)."""


@dataclass
class SaveFigures:
    """One step saved by every rank of an attempt; times are ``time.monotonic()`` of the fleet."""

    step: int
    mode: str
    ranks: int
    started: float
    last_upload: float = 0.0
    """When the last PUT of the step was answered."""
    committed: float = 0.0
    """When an acknowledgement said the step committed (or the admin API showed it, if no ack did)."""
    committed_by_ack: bool = False
    requests: dict[str, int] = field(default_factory=dict)
    """Requests the fleet sent the control plane while the step was saved, by kind (heartbeats and
    long polls of the whole fleet included)."""

    @property
    def duration_s(self) -> float:
        return self.committed - self.started

    @property
    def commit_after_upload_s(self) -> float:
        return self.committed - self.last_upload

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "duration_s": self.duration_s, "commit_after_upload_s": self.commit_after_upload_s}


def _shard(spec: dict[str, Any], step: int, rank: int, size: int) -> tuple[bytes, str]:
    data = f"{spec['attempt_id']}:{step}:{rank}:".encode().ljust(size, b".")
    return data, shard_key(job_checkpoint_prefix(spec["job_id"]), step, spec["attempt_number"], rank)


def _info(spec: dict[str, Any], step: int, rank: int, key: str, data: bytes, wait_s: float,
          upload_s: float, started: float) -> dict[str, Any]:
    return {"rank": rank, "step": step, "world_size": spec["nnodes"] * spec["nproc_per_node"], "key": key,
            "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "upload": {"wait_s": round(wait_s, 6), "upload_s": round(upload_s, 6), "slot": "granted"},
            "blocking_s": 0.0, "background_s": round(time.monotonic() - started, 6)}


async def _send(agent: SimAgent, path: str, body: dict[str, Any], *, kind: str,
                timeout: float = 60.0) -> httpx.Response:
    """A worker's request relayed by its agent (counted as ``kind``, retried on 5xx as the agent's)."""
    return await agent._post(path, body, timeout=timeout, kind=kind, http=agent.saves_http)


def _json(r: httpx.Response, what: str) -> dict[str, Any]:
    if r.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {r.status_code} {r.text[:300]}")
    body: dict[str, Any] = r.json()
    return body


async def _put(s3: httpx.AsyncClient, grants: dict[str, Any] | None, key: str, data: bytes) -> None:
    grant = (grants or {}).get("grants", [None])[0]
    if grant is None or grant["action"] != "put":
        raise RuntimeError(f"no single-PUT grant for {key}: {grants}")
    r = await s3.request(grant["method"], grant["url"], content=data, headers=grant["headers"])
    if r.status_code != 200:
        raise RuntimeError(f"PUT {key}: HTTP {r.status_code} {r.text[:300]}")


class _Commit:
    def __init__(self, figures: SaveFigures) -> None:
        self.figures = figures

    def uploaded(self) -> None:
        self.figures.last_upload = max(self.figures.last_upload, time.monotonic())

    def acked(self, ack: dict[str, Any]) -> None:
        if self.figures.step in ack.get("committed_steps", []) and not self.figures.committed_by_ack:
            self.figures.committed, self.figures.committed_by_ack = time.monotonic(), True


async def _report(agent: SimAgent, run: SimRun, shards: list[dict[str, Any]], commit: _Commit) -> None:
    body = {"fencing_token": run.spec["fencing_token"], "node_rank": run.spec["node_rank"], "shards": shards}
    r = await _send(agent, f"{AGENT}/attempts/{run.attempt_id}/shards", body, timeout=120.0, kind="shards")
    commit.acked(_json(r, f"{agent.name}: shard report"))


class _Relay:
    """A node's shard relay: whatever is queued goes in the next report (at most RELAY_BATCH)."""

    def __init__(self, agent: SimAgent, run: SimRun, commit: _Commit) -> None:
        self.agent, self.run, self.commit = agent, run, commit
        self.queued: list[dict[str, Any]] = []
        self.ready = asyncio.Event()

    def add(self, shard: dict[str, Any]) -> None:
        self.queued.append(shard)
        self.ready.set()

    async def send(self, expected: int) -> None:
        sent = 0
        while sent < expected:
            if not self.queued:
                self.ready.clear()
                await self.ready.wait()
                continue
            batch, self.queued = self.queued[:RELAY_BATCH], self.queued[RELAY_BATCH:]
            await _report(self.agent, self.run, batch, self.commit)
            sent += len(batch)


async def _per_rank(agent: SimAgent, run: SimRun, step: int, size: int, s3: httpx.AsyncClient,
                    commit: _Commit) -> None:
    spec, base = run.spec, f"{AGENT}/attempts/{run.attempt_id}"
    fenced = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"]}
    relay = _Relay(agent, run, commit)

    async def save(local: int) -> None:
        rank = spec["node_rank"] * spec["nproc_per_node"] + local
        data, key = _shard(spec, step, rank, size)
        started = time.monotonic()
        while True:  # worker_runtime/checkpoint/slots.py acquire
            ask = {**fenced, "rank": rank, "step": step, "size_bytes": len(data), "wait_s": SLOT_WAIT_S}
            answer = _json(await _send(agent, f"{base}/upload-slots", ask, timeout=SLOT_WAIT_S + 10, kind="slot"),
                           f"{agent.name}: upload slot of rank {rank}")
            if answer["state"] == "granted":
                break
            await asyncio.sleep(float(answer.get("retry_after_s") or 0.0))
        waited = time.monotonic() - started
        grants = _json(await _send(agent, f"{base}/storage", {**fenced, "rank": rank, "method": "PUT", "key": key,
                                                             "size_bytes": len(data)}, kind="grant"),
                       f"{agent.name}: PUT grant of rank {rank}")
        put_started = time.monotonic()
        await _put(s3, grants, key, data)
        put_s = time.monotonic() - put_started
        commit.uploaded()
        relay.add(_info(spec, step, rank, key, data, waited, put_s, started))
        release = {**fenced, "rank": rank, "step": step, "ok": True, "uploaded_bytes": len(data), "upload_s": put_s}
        _json(await _send(agent, f"{base}/upload-slots/release", release, kind="release"),
              f"{agent.name}: slot release of rank {rank}")

    sending = asyncio.ensure_future(relay.send(spec["nproc_per_node"]))
    try:
        await asyncio.gather(*(save(local) for local in range(spec["nproc_per_node"])))
        await sending
    finally:
        sending.cancel()


async def _put_one(spec: dict[str, Any], step: int, rank: int, data: bytes, key: str, grants: dict[str, Any],
                   s3: httpx.AsyncClient, commit: _Commit, waited: float,
                   started: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """One granted rank's PUT: its shard info and its slot release."""
    put_started = time.monotonic()
    await _put(s3, grants, key, data)
    put_s = time.monotonic() - put_started
    commit.uploaded()
    release = {"rank": rank, "step": step, "ok": True, "uploaded_bytes": len(data), "upload_s": put_s}
    return _info(spec, step, rank, key, data, waited, put_s, started), release


async def _per_node(agent: SimAgent, run: SimRun, step: int, size: int, s3: httpx.AsyncClient,
                    commit: _Commit) -> None:
    spec, base = run.spec, f"{AGENT}/attempts/{run.attempt_id}"
    fenced = {"fencing_token": spec["fencing_token"], "node_rank": spec["node_rank"]}
    started = time.monotonic()
    waiting = {}
    for local in range(spec["nproc_per_node"]):
        rank = spec["node_rank"] * spec["nproc_per_node"] + local
        waiting[rank] = _shard(spec, step, rank, size)
    releases: list[dict[str, Any]] = []
    while waiting or releases:
        asks = [{"rank": rank, "step": step, "size_bytes": len(data)} for rank, (data, _) in waiting.items()]
        body = {**fenced, "wait_s": SLOT_WAIT_S if asks else 0.0, "asks": asks, "releases": releases}
        r = await _send(agent, f"{base}/upload-slots/batch", body, timeout=SLOT_WAIT_S + 10, kind="slot-batch")
        if r.status_code in (404, 405):
            raise BatchUnavailable(f"POST {base}/upload-slots/batch: HTTP {r.status_code}")
        answers = _json(r, f"{agent.name}: slot batch")["answers"]
        releases = []
        granted = [a for a in answers if a["state"] == "granted" and a["rank"] in waiting]
        if not granted:
            if waiting:
                await asyncio.sleep(min([float(a.get("retry_after_s") or 0.0) for a in answers] or [0.0]))
            continue
        waited = time.monotonic() - started
        requests = [{"rank": a["rank"], "method": "PUT", "key": waiting[a["rank"]][1],
                     "size_bytes": len(waiting[a["rank"]][0]), "upload_id": None} for a in granted]
        r = await _send(agent, f"{base}/storage/batch", {**fenced, "requests": requests}, kind="grant-batch")
        if r.status_code in (404, 405):
            raise BatchUnavailable(f"POST {base}/storage/batch: HTTP {r.status_code}")
        grants = _json(r, f"{agent.name}: grant batch")["answers"]
        if len(grants) != len(granted) or any(g.get("grants") is None for g in grants):
            raise RuntimeError(f"{agent.name}: grant batch refused: {grants}")

        done = await asyncio.gather(*(_put_one(spec, step, a["rank"], *waiting[a["rank"]], g["grants"], s3, commit,
                                               waited, started) for a, g in zip(granted, grants, strict=True)))
        shards = [shard for shard, _ in done]
        releases = [release for _, release in done]
        for a in granted:
            del waiting[a["rank"]]
        for chunk in range(0, len(shards), RELAY_BATCH):
            await _report(agent, run, list(shards[chunk:chunk + RELAY_BATCH]), commit)


async def checkpoint(fleet: Fleet, parts: list[tuple[SimAgent, SimRun]], step: int, *, mode: str = "rank",
                     size: int = 256) -> SaveFigures:
    """Every rank of ``parts`` saves a ``size``-byte shard of ``step`` through the protocol ``mode``
    (module docstring); returns when the step is committed."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    ranks = sum(run.spec["nproc_per_node"] for _, run in parts)
    figures = SaveFigures(step=step, mode=mode, ranks=ranks, started=time.monotonic())
    commit = _Commit(figures)
    before = dict(fleet.requests)
    save = _per_rank if mode == "rank" else _per_node
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as s3:
        await asyncio.gather(*(save(agent, run, step, size, s3, commit) for agent, run in parts))
    if not figures.committed_by_ack:  # committed by the maintenance loop (e.g. S3 was slow)
        job_id = parts[0][1].spec["job_id"]
        deadline = time.monotonic() + 60.0
        while True:
            r = await fleet.http.get(f"/v1/jobs/{job_id}/checkpoints", headers=fleet.admin)
            if any(c["step"] == step and c["state"] == "committed" for c in r.json()["items"]):
                figures.committed = time.monotonic()
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"step {step} of job {job_id} not committed within 60 s of its last report")
            await asyncio.sleep(0.05)
    figures.requests = {k: v - before.get(k, 0) for k, v in fleet.requests.items() if v - before.get(k, 0)}
    return figures
