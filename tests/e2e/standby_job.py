"""tiny_gpt, after one line that says whether this rank runs in a warm standby (tests/e2e/test_standby.py).

Its parent is then node_agent.ranks.standby (the rank shim's is torchrun), and torch was imported before
this script's first line.

``--hold-at-step N --standbys DIR:K [--standbys DIR:K]...`` (first attempt only): after step N,
wait until K standbys listen in each DIR, so that those the agents start in place of the ones this
attempt took (once each of its ranks has stepped, node_agent/loops/supervise.py) are warm before
the test's fault comes. The wait is inside the step loop: the other ranks wait in the next
collective, without using a CPU.
"""

import os
import sys
import time
from pathlib import Path

with open(f"/proc/{os.getppid()}/cmdline") as cmdline:
    parent = cmdline.read().split("\0")
print(f"standby_check rank={os.environ['RANK']} attempt={os.environ['TRAINYARD_ATTEMPT_NUMBER']} "
      f"in_standby={'node_agent.ranks.standby' in parent} torch_loaded={'torch' in sys.modules}", flush=True)

args = sys.argv[1:]
hold_step: int | None = None
wanted: list[tuple[Path, int]] = []
while args[:1] in (["--hold-at-step"], ["--standbys"]):
    flag, value, args = args[0], args[1], args[2:]
    if flag == "--hold-at-step":
        hold_step = int(value)
    else:
        directory, _, count = value.rpartition(":")
        wanted.append((Path(directory), int(count)))

from worker_runtime.examples import tiny_gpt  # noqa: E402 - after the line above, which must see a bare interpreter

if hold_step is not None and os.environ["TRAINYARD_ATTEMPT_NUMBER"] == "1":
    step_once = tiny_gpt.Trainer.train_step

    def train_step(self, reporter=None):  # type: ignore[no-untyped-def]
        loss = step_once(self, reporter)
        if self.step.value == hold_step:
            deadline = time.monotonic() + 90
            while any(len(list(d.glob("*.sock"))) < k for d, k in wanted):
                if time.monotonic() > deadline:
                    sys.exit(f"standby_job: the standbys never listened again in {wanted}")
                time.sleep(0.2)
        return loss

    tiny_gpt.Trainer.train_step = train_step

sys.exit(tiny_gpt.main(args))
