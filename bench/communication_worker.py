"""Run under torchrun by bench/communication.py: calibrate this world, then train a few steps of
every layout asked for and measure them with the worker runtime's own meter.

    torchrun ... bench/communication_worker.py --layouts '[{"name": "ddp", "layout": {"kind": "ddp"}}]'

Calibration, on every rank at once (so a rank's share of the CPU cores is what it is when training):
- the FLOP rate of a matmul of the model's MLP shape;
- an all-reduce sweep (4 KiB to 8 MiB): the mean time per all-reduce at each size;
- the model's step without collectives (its FLOP rate, hence the MFU on this CPU) and the wait for
  the slowest rank after it.

Then, per layout: TinyGPT from one seed, wrapped by ``worker_runtime.layouts.apply_layout``,
``--warmup`` steps, then ``--steps`` measured steps (worker_runtime.comm_meter: step time, exposed
and busy communication, bytes), averaged over ranks. Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

from trainyard.protocol.layout import Layout
from worker_runtime import WorkerContext, init_distributed, shutdown_distributed
from worker_runtime.examples.tiny_gpt_model import TinyGPT
from worker_runtime.layouts import apply_layout

SWEEP_BYTES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def _mean_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def _max_over_ranks(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def matmul_rate(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """FLOP/s of an (m x k) @ (k x n) matmul, with every rank computing at the same time."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    dist.barrier()
    reps, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        a @ b
        reps += 1
    return _mean_over_ranks([2.0 * m * k * n * reps / elapsed])[0]


def all_reduce_sweep(rounds: int = 3, reps: int = 4) -> list[list[float]]:
    """[bytes, seconds per all-reduce] for each size of the sweep: the slowest rank's mean over
    ``reps``, the best of ``rounds`` (other work on the machine only ever adds time)."""
    for nbytes in SWEEP_BYTES:  # the first collectives of a size cost more (buffers, connections)
        for _ in range(2):
            dist.all_reduce(torch.ones(nbytes // 4))
    out = []
    for nbytes in SWEEP_BYTES:
        t = torch.ones(nbytes // 4)
        best = float("inf")
        for _ in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            for _ in range(reps):
                dist.all_reduce(t)
            [seconds] = _max_over_ranks([(time.perf_counter() - started) / reps])
            best = min(best, seconds)
        out.append([float(nbytes), best])
    return out


def op_probe(nbytes: int = 4 << 20, reps: int = 3) -> dict[str, float]:
    """Seconds per collective of ``nbytes`` (the full tensor), the slowest rank's mean, for the three
    kinds the layouts use: which one runs slower than the ring model says (bench/shaped_links.py)."""
    n = dist.get_world_size()
    full, part = torch.ones(nbytes // 4), torch.ones(nbytes // 4 // n)
    ops = {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: dist.all_gather_into_tensor(full, part),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
    }
    out = {}
    for name, op in ops.items():
        op()  # the first of a kind sets up its buffers
        dist.barrier()
        started = time.perf_counter()
        for _ in range(reps):
            op()
        [out[name]] = _max_over_ranks([(time.perf_counter() - started) / reps])
    return out


def probe_compute(args: argparse.Namespace, ctx: WorkerContext, steps: int = 6) -> dict[str, float]:
    """The model's own step without any collective (forward, backward, optimizer), every rank at
    once, and the wait for the slowest rank after it (a barrier): the compute a layout adds its
    communication to, and the skew every first collective of a step absorbs."""
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(ctx.rank))
    compute, wait = [], []
    for i in range(2 + steps):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        done = time.perf_counter()
        dist.barrier()
        if i >= 2:
            compute.append(done - started)
            wait.append(time.perf_counter() - done)
    compute_s, wait_s = _mean_over_ranks([sum(compute) / steps, sum(wait) / steps])
    return {"compute_s": compute_s, "wait_s": wait_s, "tokens": args.batch * args.seq}


def measure(ctx: WorkerContext, layout: Layout, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyGPT(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    params = sum(p.numel() for p in model.parameters())  # tied weights count once
    shapes = [list(p.shape) for p in model.parameters()]
    units = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    parallel = apply_layout(model, dataclasses.replace(ctx, layout=layout))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    generator = torch.Generator().manual_seed(1 + ctx.rank)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator) for _ in range(8)]
    parallel.settle(batches[0][:1, :-1])

    def step(i: int) -> None:
        with parallel.meter.step():
            optimizer.zero_grad(set_to_none=True)
            for micro in range(parallel.accum_steps):
                tokens = batches[(i * parallel.accum_steps + micro) % len(batches)]
                with parallel.micro_step(micro):
                    logits = parallel.module(tokens[:, :-1])
                    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
                    (loss / parallel.accum_steps).backward()
            optimizer.step()

    for i in range(args.warmup):
        step(i)
    parallel.meter.splits()  # drop the warm-up
    dist.barrier()
    for i in range(args.steps):
        step(args.warmup + i)
    splits = parallel.meter.splits()
    n = len(splits)
    mine = [sum(s.step_s for s in splits) / n, sum(s.comm_s for s in splits) / n,
            sum(s.comm_busy_s for s in splits) / n, sum(s.comm_bytes for s in splits) / n]
    step_s, comm_s, busy_s, comm_bytes = _mean_over_ranks(mine)
    return {"params": params, "shapes": shapes, "unit_params": units, "step_s": step_s, "comm_s": comm_s,
            "comm_busy_s": busy_s, "comm_bytes": comm_bytes,
            "tokens_per_rank": args.batch * args.seq * parallel.accum_steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True, help="JSON list of {name, layout}")
    for name, default in (("steps", 8), ("warmup", 3), ("vocab", 256), ("seq", 32), ("batch", 2),
                          ("d_model", 256), ("layers", 2), ("heads", 4)):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--op-probe", action="store_true", help="also time one all-reduce, all-gather and "
                        "reduce-scatter of 4 MiB")
    args = parser.parse_args()
    ctx = WorkerContext.from_env()
    init_distributed(ctx, timeout=120)
    try:
        out: dict[str, Any] = {
            "world_size": ctx.world_size,
            "local_world_size": ctx.local_world_size,
            "flops": matmul_rate(args.batch * args.seq, args.d_model, 4 * args.d_model),
            "sweep": all_reduce_sweep() if ctx.world_size > 1 else [],
            "probe": probe_compute(args, ctx),
            "layouts": {},
        }
        if args.op_probe and ctx.world_size > 1:
            out["ops"] = op_probe()
        for item in json.loads(args.layouts):
            try:
                out["layouts"][item["name"]] = measure(ctx, Layout.model_validate(item["layout"]), args)
            except RuntimeError as exc:  # a collective gloo does not implement for this dtype, say
                out["layouts"][item["name"]] = {"error": str(exc).splitlines()[0][:200]}
                dist.barrier()
        if ctx.is_main:
            print(json.dumps(out), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
