"""Set up and tear down torch.distributed for one worker process.

The backend follows the device the agent gave the attempt: NCCL on GPUs, gloo on CPU-only nodes
(virtual slots). Rendezvous is ``env://``: torchrun has already set MASTER_ADDR/MASTER_PORT to the
port the control plane reserved for this attempt, so nothing here picks addresses. A restartable
attempt's ranks join a fenced rendezvous instead (``ctx.rendezvous``: explicit rank, world size and
store; trainyard/protocol/restart.py), so that a process can leave one attempt's group and join
the next one's without torchrun's environment.
"""

from __future__ import annotations

import gc
import logging
import os
from datetime import timedelta
from urllib.parse import quote

import httpx
import torch
import torch.distributed as dist

from trainyard.protocol.env import LOCAL_API_PREFIX
from trainyard.protocol.rendezvous import wait_for_listener
from trainyard.protocol.restart import VERIFIER_KEY, rendezvous_keyspace, rendezvous_verifier
from worker_runtime.agent_http import agent_client
from worker_runtime.context import WorkerContext

log = logging.getLogger(__name__)

_STORE: dist.TCPStore | None = None
"""The fenced rendezvous's store; global rank 0 hosts it, so it lives as long as the group."""


class StaleRendezvousError(RuntimeError):
    """The rendezvous belongs to another attempt than the token this process holds: never joined."""

ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_OMP_NUM_THREADS = "OMP_NUM_THREADS"


def init_distributed(ctx: WorkerContext, *, timeout: timedelta | float | None = None) -> bool:
    """Initialise the default process group for ``ctx``; return whether one is now active.

    ``timeout`` (seconds or a timedelta) bounds rendezvous and every collective, so a peer that
    died makes the survivors fail instead of hanging until the agent kills them; None keeps
    torch's default. A standalone process (world size 1 and no MASTER_ADDR) gets no process group,
    so plain ``python train.py`` needs no rendezvous. Calling it again is a no-op.
    """
    if ctx.device == "cuda":
        # Before the process group: NCCL binds each rank to the current device.
        torch.cuda.set_device(ctx.local_rank)
    if dist.is_initialized():
        return True
    if ctx.world_size == 1 and not os.environ.get(ENV_MASTER_ADDR) and ctx.rendezvous is None:
        return False
    if ctx.device == "cpu":
        _limit_cpu_threads()
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=timeout)
    backend = "nccl" if ctx.device == "cuda" else "gloo"
    device_id = torch.device("cuda", ctx.local_rank) if ctx.device == "cuda" else None
    if ctx.rendezvous is not None:
        store = fenced_store(ctx, timeout=timeout or timedelta(minutes=5))
        dist.init_process_group(backend=backend, store=store, rank=ctx.rank, world_size=ctx.world_size,
                                timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend=backend, init_method="env://", rank=ctx.rank, world_size=ctx.world_size,
                                timeout=timeout, device_id=device_id)
    log.info(
        "process group ready: backend=%s rank=%d/%d local_rank=%d node_rank=%d",
        backend,
        ctx.rank,
        ctx.world_size,
        ctx.local_rank,
        ctx.node_rank,
    )
    tell_ready(ctx)
    return True


def tell_ready(ctx: WorkerContext, timeout_s: float = 2.0) -> bool:
    """Tell the agent this rank's process group is initialised: a recovery's rendezvous phase ends
    when every rank did (docs/architecture.md, "Recovery phases"). Best effort: a timing must never
    stop training, so any failure is logged and forgotten. True if the agent accepted it."""
    if not ctx.managed:
        return False
    url = f"{ctx.agent_url}{LOCAL_API_PREFIX}/attempts/{quote(ctx.attempt_id, safe='')}/ready"
    try:
        with agent_client(ctx, timeout_s) as client:
            response = client.post(url, json={"fencing_token": ctx.fencing_token, "rank": ctx.rank})
    except httpx.HTTPError as exc:
        log.warning("could not tell the agent the process group is ready: %s", exc)
        return False
    if not response.is_success:
        log.warning("the agent refused the ready report: HTTP %d", response.status_code)
    return response.is_success


def fenced_store(ctx: WorkerContext, *, timeout: timedelta) -> dist.Store:
    """The attempt's store, joined only with its token (docs/architecture.md, "In-process restart").

    Global rank 0 hosts a TCPStore on the attempt's rendezvous port and publishes the verifier of
    (attempt id, token); every other rank reads it before anything else and refuses a mismatch
    (StaleRendezvousError) instead of joining. The group's keys live under a prefix derived from the
    token, which the verifier does not reveal.
    """
    global _STORE
    assert ctx.rendezvous is not None
    host, port, main = ctx.rendezvous.host, ctx.rendezvous.port, ctx.rank == 0
    if not main:
        # A fresh rank 0 may still be importing torch: connect once it listens, not at a step of
        # torch's connect backoff (trainyard/protocol/rendezvous.py).
        wait_for_listener(host, port, timeout.total_seconds())
    store = dist.TCPStore(host, port, world_size=None, is_master=main, timeout=timeout, wait_for_workers=False)
    mine = rendezvous_verifier(ctx.attempt_id, ctx.fencing_token)
    if main:
        store.set(VERIFIER_KEY, mine)
    else:
        theirs = store.get(VERIFIER_KEY).decode(errors="replace")
        if theirs != mine:
            raise StaleRendezvousError(
                f"the rendezvous at {host}:{port} is not attempt {ctx.attempt_id}'s with this process's token: "
                "refused (a worker of an earlier attempt never joins a later one)")
    _STORE = store
    return dist.PrefixStore(rendezvous_keyspace(ctx.attempt_id, ctx.fencing_token), store)


def abort_distributed() -> None:
    """Leave a process group whose peer failed, so that the process can join another one.

    NCCL communicators are aborted (a collective in flight would otherwise block their destruction);
    gloo's are destroyed. Errors are logged, not raised: the group is unusable either way.
    """
    global _STORE
    if dist.is_available() and dist.is_initialized():
        gc.collect()
        try:
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if dist.get_backend() == "nccl" and abort is not None:
                abort()
            else:
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the group is broken; what matters is that it is gone
            log.exception("aborting the process group failed")
    _STORE = None


def shutdown_distributed() -> None:
    """Destroy the default process group if there is one; safe to call any number of times.

    Drop DDP modules first (let them go out of scope): a DDP reducer destroyed after its gloo
    group can hang the process at exit.
    """
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # DDP modules caught in reference cycles go before their group, not after
        dist.destroy_process_group()


def is_distributed() -> bool:
    """True when a default process group is active."""
    return dist.is_available() and dist.is_initialized()


def settle_ddp_buckets(ddp: torch.nn.Module, *example: torch.Tensor) -> None:
    """Run one forward and backward on ``example`` and throw the gradients away, so that DDP has
    rebuilt its gradient buckets before the first real step. Call it on every rank, right after
    wrapping the model.

    DDP reduces the first backward of a process in one bucket in parameter order and every later
    one in buckets ordered by when gradients become ready. The bucket layout decides how elements
    are chunked for the ring all-reduce, hence the order in which more than two ranks' values are
    summed: without this, the first step after a restore sums in another order than the
    uninterrupted run did at that step, and a resumed run with three or more ranks ends a few ulps
    away from it. The example batch changes no state: no optimizer step, no data consumed, and the
    module's buffers (BatchNorm's running statistics) and the random streams its forward draws from
    (dropout) are put back as they were. Without that, a script that restores its checkpoint
    (``loop.restore()``) before wrapping the model would move the restored state before its first
    step, and its resumed run would not be exact.
    """
    module = getattr(ddp, "module", ddp)
    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    devices = sorted({b.device.index or 0 for b in module.parameters() if b.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):  # the CPU stream, and the CUDA streams the model is on
        out = ddp(*example)
        loss = out.float().sum() * 0.0
        loss.backward()
    for p in ddp.parameters():
        p.grad = None
    with torch.no_grad():
        for buffer, saved in buffers:
            buffer.copy_(saved)


def device_of(ctx: WorkerContext) -> torch.device:
    """The torch device this worker computes on."""
    return torch.device("cuda", ctx.local_rank) if ctx.device == "cuda" else torch.device("cpu")


def _limit_cpu_threads() -> None:
    # Several CPU workers share a node's cores; each using every core oversubscribes them badly
    # (intra-op thread pools fight). One thread each, unless the operator chose otherwise.
    raw = os.environ.get(ENV_OMP_NUM_THREADS, "").strip()
    try:
        threads = int(raw) if raw else 1
    except ValueError:
        log.warning("ignoring %s=%r (not an integer)", ENV_OMP_NUM_THREADS, raw)
        threads = 1
    torch.set_num_threads(max(1, threads))
