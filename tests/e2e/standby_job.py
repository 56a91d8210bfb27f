"""tiny_gpt, after one line that says whether this rank runs in a warm standby (tests/e2e/test_standby.py).

Its parent is then node_agent.ranks.standby (the rank shim's is torchrun), and torch was imported before
this script's first line. ``--standbys DIR:N`` (first attempt only): wait until N standbys listen
in DIR again before training, so that those the agent started in place of this attempt's (at idle
priority, behind busy ranks) are warm when the recovery comes."""

import os
import runpy
import sys
import time
from pathlib import Path

if len(sys.argv) > 2 and sys.argv[1] == "--standbys":
    directory, _, count = sys.argv[2].rpartition(":")
    del sys.argv[1:3]
    deadline = time.monotonic() + 90
    while os.environ["TRAINYARD_ATTEMPT_NUMBER"] == "1" and len(list(Path(directory).glob("*.sock"))) < int(count):
        if time.monotonic() > deadline:
            sys.exit(f"standby_job: {count} standbys never listened in {directory} again")
        time.sleep(0.2)

with open(f"/proc/{os.getppid()}/cmdline") as cmdline:
    parent = cmdline.read().split("\0")
print(f"standby_check rank={os.environ['RANK']} attempt={os.environ['TRAINYARD_ATTEMPT_NUMBER']} "
      f"in_standby={'node_agent.ranks.standby' in parent} torch_loaded={'torch' in sys.modules}", flush=True)
sys.argv = ["tiny_gpt", *sys.argv[1:]]
runpy.run_module("worker_runtime.examples.tiny_gpt", run_name="__main__", alter_sys=True)
