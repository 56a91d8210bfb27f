"""The rendezvous store at up to 1,024 ranks: what a recovery's rendezvous costs the one process that hosts it.

    .venv/bin/python bench/rendezvous_scale.py [--ranks 128,256,512,1024] [--processes 8]

Every attempt's process group meets at one TCPStore: torchrun's static rendezvous store on node
rank 0 for a default job, the fenced store global rank 0 hosts for a restartable one
(worker_runtime/distributed.py, ``fenced_store``). What a rank does there when an NCCL group starts
is a few operations: it publishes its own key, reads rank 0's (NCCL's unique id; the fenced
store's verifier), and counts itself in. This script runs that pattern for N ranks against one
TCPStore server in this process: the ranks are threads in ``--processes`` client processes, each
with its own connection as ranks on other hosts would have. Every client imports torch and
connects first; the clock starts when all are connected and told to go (a recovery's rendezvous
starts once its ranks exist) and stops when the last rank has read rank 0's key and counted
itself. Printed per N: that time, and the CPU time of the process that hosts the store over the
same span (the store's event loop and this script's waiting thread). Each N in the same run; the
ratios are against the smallest N, so that the growth, not this machine, is what the table says.

It measures the store alone: not NCCL's own bootstrap and communicator set-up (GPUs, many of them),
nor gloo's full mesh (N^2 connections: gloo is this CPU machine's backend, not a 1,024-GPU job's).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import sys
import threading
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=300)


def _client(port: int, ranks: list[int], world: int, ready: Any, go: Any, out: Any) -> None:
    from torch.distributed import TCPStore  # noqa: PLC0415 - imported in the client process

    stores = [TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT, wait_for_workers=False)
              for _ in ranks]
    ready.put(len(stores))
    go.wait()
    ended: list[float] = []
    errors: list[str] = []

    def one(rank: int, store: Any) -> None:
        try:
            store.set(f"rank{rank}/address", f"10.0.{rank // 256}.{rank % 256}:29500")
            store.get("rank0/address")  # waits until rank 0 published it (NCCL's unique id)
            store.add("counted", 1)
            ended.append(time.time())
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"rank {rank}: {exc}")

    threads = [threading.Thread(target=one, args=(r, s)) for r, s in zip(ranks, stores, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((max(ended) if ended else None, errors))


def measure(world: int, processes: int) -> dict[str, float]:
    from torch.distributed import TCPStore  # noqa: PLC0415

    server = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    groups = [g for g in (list(range(i, world, processes)) for i in range(processes)) if g]
    clients = [ctx.Process(target=_client, args=(server.port, g, world, ready, go, out)) for g in groups]
    for c in clients:
        c.start()
    connected = sum(ready.get(timeout=300) for _ in clients)
    assert connected == world
    started, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    go.set()
    server.set("rank0/address", "10.0.0.0:29500")  # rank 0 publishes, as the others start
    results = [out.get(timeout=300) for _ in clients]
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    for c in clients:
        c.join(30)
    errors = [e for _, errs in results for e in errs]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed, e.g. {errors[0]}")
    if int(server.add("counted", 0)) != world:
        raise RuntimeError("not every rank counted itself")
    last = max(t for t, _ in results if t is not None)
    return {"world": world, "wall_s": last - started,
            "store_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="128,256,512,1024")
    parser.add_argument("--processes", type=int, default=8)
    args = parser.parse_args()
    worlds = [int(w) for w in args.ranks.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * max(worlds) + 256)), hard))
    rows = [measure(w, args.processes) for w in worlds]
    base = rows[0]
    print(f"rendezvous store: one TCPStore server, {args.processes} client processes, {os.cpu_count()} CPUs")
    print("| ranks | connected -> last rank through | vs smallest | store host CPU | vs smallest |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['world']} | {r['wall_s']:.3f} s | {r['wall_s'] / base['wall_s']:.2f} | "
              f"{r['store_cpu_s']:.3f} s | {r['store_cpu_s'] / max(base['store_cpu_s'], 1e-6):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
