"""A job that takes steps and trains nothing: no model and no torch in its workers, which still run
under the agents' real torchrun and report through worker_runtime's Reporter like any job.

    steps_job.py --steps N [--step-delay-s S]

For the end-to-end tests whose subject is where and when jobs run (gangs, reservations, fairness),
not what they compute: a torch worker costs about 4 CPU-s to start on the 2-core test machine
(torch, and the dynamo import DDP makes), this one about 0.3. Rank 0's result holds the steps taken.
"""

from __future__ import annotations

import argparse
import time

from worker_runtime import Reporter, WorkerContext

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--step-delay-s", type=float, default=0.0)
args = parser.parse_args()
ctx = WorkerContext.from_env()
with Reporter(ctx, total_steps=args.steps) as reporter:
    for step in range(1, args.steps + 1):
        time.sleep(args.step_delay_s)
        reporter.progress(step)
    if ctx.is_main:
        reporter.result({"steps": args.steps, "world_size": ctx.world_size})
