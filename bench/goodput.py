"""The goodput model on the published case (docs/goodput.md): Llama 3's 16,384 GPUs (2,048 nodes of 8),
419 unexpected interruptions in 54 days, blocking costs of ~6 s (async) and ~150 s (sync) per save
of a 7B model with torch.distributed.checkpoint; what recovery time and spare capacity reach 97%
(ByteRobust). Prints markdown tables; pure and seeded (the same output every run).

    .venv/bin/python bench/goodput.py [--runs 10]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from control_plane.goodput.rules import young_daly_interval_s
from control_plane.goodput.simulate import Scenario, closed_form_goodput, mean_outcome, sweep

NODES, INTERRUPTIONS, DAYS = 2048, 419, 54
NODE_MTBF_H = DAYS * 24 * NODES / INTERRUPTIONS
WORK_H = DAYS * 24.0


def best(s: Scenario, runs: int) -> tuple[float, float]:
    return max(sweep(replace(s, interval_s=young_daly_interval_s(s.blocking_s, s.job_mtbf_s) or 1.0), runs),
               key=lambda p: p[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    runs = parser.parse_args().runs
    base = Scenario(nodes=NODES, node_mtbf_h=NODE_MTBF_H, work_h=WORK_H, interval_s=1.0, blocking_s=6,
                    recovery_s=600)
    mtbf = base.job_mtbf_s
    print(f"job MTBF {mtbf:,.0f} s ({mtbf / 3600:.2f} h), node MTBF {NODE_MTBF_H:,.0f} h; {runs} runs per figure\n")
    print("| saves | blocking | upload after | interval (Young) | best simulated | goodput, R = 10 min "
          "| closed form (sync) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, blocking, background in (("async", 6.0, 150.0), ("sync", 150.0, 0.0)):
        young = young_daly_interval_s(blocking, mtbf)
        s = replace(base, blocking_s=blocking, background_s=background, interval_s=young)
        at_young = mean_outcome(s, runs).goodput
        interval, _ = best(s, runs)
        closed = closed_form_goodput(young, blocking, mtbf, 600) if background == 0 else None
        print(f"| {name} | {blocking:g} s | {background:g} s | {young:,.0f} s ({young / 60:.1f} min) "
              f"| {interval:,.0f} s |"
              f" {100 * at_young:.1f}% | {'-' if closed is None else f'{100 * closed:.1f}%'} |")
    print("\nGoodput with a node always at hand, by recovery time (failure -> training again) and blocking cost"
          " (async, 150 s upload; each at its best interval):\n")
    recoveries = (30, 60, 120, 300, 600)
    print("| blocking \\ recovery | " + " | ".join(f"{r} s" for r in recoveries) + " |")
    print("| --- |" + " --- |" * len(recoveries))
    for blocking in (6.0, 1.0, 0.2):
        cells = []
        for r in recoveries:
            s = replace(base, blocking_s=blocking, background_s=150.0, recovery_s=r)
            cells.append(f"{100 * best(s, runs)[1]:.1f}%")
        print(f"| {blocking:g} s | " + " | ".join(cells) + " |")
    print("\nSpare nodes, with failed nodes back after a repair of 24 h or 4 h (recovery 60 s, blocking 1 s,"
          " async):\n")
    spares = (0, 2, 4, 8, 12, 16, 24)
    print("| repair \\ spares | " + " | ".join(map(str, spares)) + " | always one |")
    print("| --- |" + " --- |" * (len(spares) + 1))
    for repair in (24.0, 4.0):
        s = replace(base, blocking_s=1.0, background_s=150.0, recovery_s=60, repair_h=repair)
        interval, _ = best(s, runs)
        cells = [f"{100 * mean_outcome(replace(s, interval_s=interval, spares=n), runs).goodput:.1f}%"
                 for n in (*spares, None)]
        print(f"| {repair:g} h | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
