"""Communication on links with real limits (issue 29): the planner's step time against the measured
one with the inter-node link shaped to two rates, and rack-aware placement against rack-blind
placement on an oversubscribed rack uplink.

    flock /tmp/trainyard-heavy.lock .venv/bin/python bench/shaped_links.py              # root only
    .venv/bin/python bench/shaped_links.py --rates 400mbit,100mbit --node-link 400mbit --uplink 100mbit

Every "node" is a network namespace of its own (trainyard/dev/netns.py, what ``trainyard dev up
--netns`` builds): a veth link shaped with tc tbf at both ends, on its rack's bridge; a rack's
bridge reaches the others through its uplink, shaped the same way. The workers are
bench/communication_worker.py under torchrun, one torchrun per node inside the node's namespace
(static rendezvous on node rank 0, gloo over the namespace's eth0), as bench/communication.py runs
them on loopback.

1. **Planner against measurement.** For each ``--rates`` value, two nodes in one rack whose links
   run at that rate, one worker each: the world calibrates itself on the shaped link (FLOP rate of
   the model's matmul, an all-reduce sweep fitted to alpha-beta: the inter-node link class), and
   measures DDP, FSDP and DDP with 4 accumulation steps. The intra-node class is calibrated on a
   2-worker world inside one namespace (its loopback). The planner's row
   (``control_plane.planning.estimate``) with those calibrations, as bench/communication.py builds
   it, is set beside each measured step time.
2. **Placement.** Four nodes in two racks, node links at ``--node-link``, each rack's uplink at
   ``--uplink`` (oversubscribed: two node links share it); node 2 is taken by another job, so the
   free nodes are 1 (rack 1), 3 and 4 (rack 2). The scheduler's own placement function
   (``control_plane.scheduler.policy.place``) places a 2-node job with the rack label (rack-aware)
   and without it (rack-blind); the same DDP job is measured on each placement, in the same run.

The CPU must not be what is measured: the rates are chosen so that a step's communication takes
far longer than its computation, and the table prints how busy the machine's cores were during each
world (psutil, all processes): a world whose cores were saturated would be a CPU measurement.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.communication import BASE, fit_alpha_beta, planned, run_world, with_overhead  # noqa: E402
from control_plane.scheduler.model import JobDemand, NodeCapacity  # noqa: E402
from control_plane.scheduler.policy import place  # noqa: E402
from trainyard.dev.netns import Network, Shape, Topology, parse_rate  # noqa: E402

TARGET = 0.25


def _world(workers: int, nodes: list[int], net: Network, layouts: dict[str, Any],
           args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """Run a world on these nodes of ``net`` (1-based), ``workers`` over them; (its result, the
    share of the machine's CPU time that was busy meanwhile)."""
    before = psutil.cpu_times()
    hosts = ["127.0.0.1"] if len(nodes) == 1 else [net.layout.node_address(n) for n in nodes]
    world = run_world(workers, len(nodes), layouts, args, hosts=hosts,
                      prefixes=[net.exec_prefix(n) for n in nodes], ifname="lo" if len(nodes) == 1 else "eth0",
                      extra=["--op-probe"] if len(nodes) > 1 else [])
    after = psutil.cpu_times()
    total = sum(after) - sum(before)
    idle = (after.idle + after.iowait) - (before.idle + before.iowait)
    return world, (total - idle) / total if total > 0 else 0.0


def _calib(world: dict[str, Any]) -> dict[str, float]:
    alpha, bw = fit_alpha_beta(world["sweep"], world["world_size"])
    probe, params = world["probe"], world["layouts"]["ddp"]["params"]
    mfu = 6.0 * params * probe["tokens"] / (world["flops"] * probe["compute_s"])
    return {"alpha": alpha, "bw": bw, "mfu": mfu, "wait": probe["wait_s"]}


def _err(measured: float, predicted: float, hits: list[bool]) -> str:
    e = (predicted - measured) / measured
    hits.append(abs(e) <= TARGET)
    return f"{e:+.0%}" + ("" if abs(e) <= TARGET else " (miss)")


def planner_against_measurement(args: argparse.Namespace) -> None:
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    base_worlds: dict[str, tuple[dict[str, Any], float]] = {}
    shaped: dict[str, tuple[dict[str, Any], float]] = {}
    for rate in rates:
        with Network.up(2, Topology(racks=1, node_link=Shape(rate_bits=parse_rate(rate)))) as net:
            if not base_worlds:  # the 1-worker baseline and the intra-node class: once, unshaped loopback
                base_worlds["1x1"] = _world(1, [1], net, {"ddp": BASE["ddp"], "fsdp": BASE["fsdp"]}, args)
                base_worlds["2x1"] = _world(2, [1], net, {"ddp": BASE["ddp"]}, args)
                print(f"calibrated inside a node ({time.monotonic() - STARTED:.0f} s)", file=sys.stderr)
            shaped[rate] = _world(2, [1, 2], net, BASE, args)
            print(f"measured 2 nodes at {rate} ({time.monotonic() - STARTED:.0f} s)", file=sys.stderr)

    solo, probe1 = base_worlds["1x1"][0]["layouts"], base_worlds["1x1"][0]["probe"]
    overhead = {name: (solo[name]["step_s"] - solo[name]["comm_s"]) / solo[name]["tokens_per_rank"]
                / (probe1["compute_s"] / probe1["tokens"]) for name in ("ddp", "fsdp")}
    overhead["ddp, accum 4"] = overhead["ddp"]
    intra = _calib(base_worlds["2x1"][0])
    print("\n### The planner on shaped links (2 nodes x 1 worker)\n")
    print("| link | link class | fitted bandwidth | fitted alpha | vs the configured rate | CPU busy |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| loopback in a namespace | intra | {intra['bw'] / 1e6:.0f} MB/s | {intra['alpha'] * 1e6:.0f} us | - "
          f"| {base_worlds['2x1'][1]:.0%} |")
    for rate, (world, busy) in shaped.items():
        c = _calib(world)
        print(f"| {rate} | inter | {c['bw'] / 1e6:.1f} MB/s | {c['alpha'] * 1e6:.0f} us "
              f"| {c['bw'] * 8 / parse_rate(rate):.2f} | {busy:.0%} |")
    hits: list[bool] = []
    print("\n| link | layout | step measured | planner | error | comm share measured | planner |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate, (world, _) in shaped.items():
        calib = _calib(world)
        for name, layout in BASE.items():
            m = world["layouts"][name]
            step_p, comm_p = planned(layout, m, world, with_overhead(calib, overhead[name]), intra)
            print(f"| {rate} | {name} | {m['step_s'] * 1e3:.0f} ms | {step_p * 1e3:.0f} ms "
                  f"| {_err(m['step_s'], step_p, hits)} | {m['comm_s'] / m['step_s']:.0%} | {comm_p / step_p:.0%} |")
    print(f"\nwithin {TARGET:.0%} of the measurement: {sum(hits)} of {len(hits)}")
    print("\nOne collective of 4 MiB (the full tensor) on the shaped link against the ring model the planner "
          "uses (all-reduce 2(n-1)/n B / bw, all-gather and reduce-scatter (n-1)/n B / bw, plus alpha per step):\n")
    print("| link | collective | measured | ring model | measured / model |")
    print("| --- | --- | --- | --- | --- |")
    for rate, (world, _) in shaped.items():
        c, n, size = _calib(world), world["world_size"], float(4 << 20)
        model = {"all_reduce": 2 * (n - 1) * (c["alpha"] + size / n / c["bw"]),
                 "all_gather": (n - 1) * (c["alpha"] + size / n / c["bw"]),
                 "reduce_scatter": (n - 1) * (c["alpha"] + size / n / c["bw"])}
        for op, seconds in world.get("ops", {}).items():
            print(f"| {rate} | {op} | {seconds * 1e3:.0f} ms | {model[op] * 1e3:.0f} ms | {seconds / model[op]:.2f} |")


def placement(args: argparse.Namespace) -> None:
    topology = Topology(racks=2, node_link=Shape(rate_bits=parse_rate(args.node_link)),
                        rack_uplink=Shape(rate_bits=parse_rate(args.uplink)))
    nodes = [NodeCapacity(node_id=f"n{i}", name=f"node-{i}", free=() if i == 2 else (0,), total=1,
                          labels={"rack": f"r{topology.rack_of(i, 4)}"}) for i in range(1, 5)]
    job = JobDemand(job_id="j", num_nodes=2, gpus_per_node=1, submitted_at=datetime.fromtimestamp(0, UTC))
    chosen = {}
    for mode, label in (("rack-aware", "rack"), ("rack-blind", None)):
        p = place(job, nodes, topology_label=label)
        if p is None:
            raise SystemExit(f"the scheduler placed nothing ({mode})")
        chosen[mode] = [int(node_id[1:]) for node_id, _ in p.nodes]
    results = {}
    with Network.up(4, topology) as net:
        for mode, picked in chosen.items():
            results[mode] = _world(2, picked, net, {"ddp": BASE["ddp"]}, args)
            print(f"measured the {mode} placement ({time.monotonic() - STARTED:.0f} s)", file=sys.stderr)
    print(f"\n### Placement on an oversubscribed rack uplink (node links {args.node_link}, "
          f"rack uplinks {args.uplink})\n")
    print("| placement | nodes (racks) | DDP step | vs rack-aware | comm share | all-reduce bandwidth | CPU busy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    aware = results["rack-aware"][0]["layouts"]["ddp"]["step_s"]
    for mode, (world, busy) in results.items():
        m, c = world["layouts"]["ddp"], _calib(world)
        where = ", ".join(f"node-{n} ({nodes[n - 1].labels['rack']})" for n in chosen[mode])
        print(f"| {mode} | {where} | {m['step_s'] * 1e3:.0f} ms | {m['step_s'] / aware:.2f} "
              f"| {m['comm_s'] / m['step_s']:.0%} | {c['bw'] / 1e6:.1f} MB/s | {busy:.0%} |")


STARTED = time.monotonic()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="400mbit,100mbit", help="inter-node link rates of part 1")
    parser.add_argument("--node-link", default="400mbit", help="each node's link in part 2")
    parser.add_argument("--uplink", default="100mbit", help="each rack's uplink in part 2")
    parser.add_argument("--parts", default="planner,placement", help="which parts to run")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per layout")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",")}
    if "planner" in parts:
        planner_against_measurement(args)
    if "placement" in parts:
        placement(args)
    print(f"\n{time.monotonic() - STARTED:.0f} s in all", file=sys.stderr)


if __name__ == "__main__":
    main()
