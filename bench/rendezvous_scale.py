"""The rendezvous store at 1,024 ranks: what a recovery's rendezvous costs the one process that hosts it.

    .venv/bin/python bench/rendezvous_scale.py [--ranks 128,256,512,1024] [--processes 8]

Every attempt's process group meets at one TCPStore: torchrun's static rendezvous store on node
rank 0 for a default job, the fenced store global rank 0 hosts for a restartable one
(worker_runtime/distributed.py, ``fenced_store``). What a rank does there when its group starts is
a handful of operations whatever the backend: it connects, adds itself to the join counter and
waits for it to reach the world size (c10d's store barrier), and reads what rank 0 published (NCCL's
unique id, gloo's and the fenced store's verifier): ``connect, add, wait-for-count, get``. This
script runs that pattern for N ranks against one TCPStore server in this process (the ranks
are threads in ``--processes`` client processes, each with its own TCPStore connection, as ranks
on different hosts would have), and prints, per N: the time until the last rank had read rank
0's key, and the server process's CPU time for it. Each N in the same run; the ratio is against
the smallest N, so that growth, not this machine, is what the table says.

It measures the store alone: not NCCL's own bootstrap and ring setup (on GPUs, measured only
where there are many), nor gloo's full mesh (N^2 connections: gloo is this CPU machine's
backend, not a 1,024-GPU job's).
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


def _ranks(host: str, port: int, ranks: list[int], world: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    from torch.distributed import TCPStore  # noqa: PLC0415 - imported in the client process

    done: list[float] = []
    errors: list[str] = []

    def one(rank: int) -> None:
        try:
            store = TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=120),
                             wait_for_workers=False)
            store.add("joined", 1)
            while int(store.add("joined", 0)) < world:  # the store barrier's wait for the count
                time.sleep(0.005)
            store.get("rank0/address")  # what rank 0 published (NCCL's unique id, a verifier)
            done.append(time.time())
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append(f"rank {rank}: {exc}")

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((max(done) if done else None, errors))


def measure(world: int, processes: int) -> dict[str, float]:
    from torch.distributed import TCPStore  # noqa: PLC0415

    server = TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=120),
                      wait_for_workers=False)
    server.set("rank0/address", "127.0.0.1:12345")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    groups = [list(range(i, world, processes)) for i in range(processes)]
    clients = [ctx.Process(target=_ranks, args=("127.0.0.1", server.port, g, world, queue)) for g in groups if g]
    for c in clients:
        c.start()
    # The clients import torch before they connect; count from the first join, as a recovery's
    # rendezvous starts once the ranks exist.
    while int(server.add("joined", 0)) == 0:
        time.sleep(0.001)
    started, cpu0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
    results = [queue.get(timeout=300) for _ in clients]
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    for c in clients:
        c.join(30)
    errors = [e for _, errs in results for e in errs]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed, e.g. {errors[0]}")
    last = max(t for t, _ in results if t is not None)
    return {"world": world, "wall_s": last - started,
            "server_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)}


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
    print(f"rendezvous store, one TCPStore server, {args.processes} client processes, {os.cpu_count()} CPUs")
    print("| ranks | last rank through (wall) | vs smallest | server CPU | vs smallest |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['world']} | {r['wall_s']:.3f} s | {r['wall_s'] / base['wall_s']:.2f} | "
              f"{r['server_cpu_s']:.3f} s | {r['server_cpu_s'] / max(base['server_cpu_s'], 1e-6):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
