"""tiny_gpt, after one line that says whether this rank runs in a warm standby (tests/e2e/test_standby.py).

Its parent is then node_agent.ranks.standby (the rank shim's is torchrun), and torch was imported before
this script's first line."""

import os
import runpy
import sys

with open(f"/proc/{os.getppid()}/cmdline") as cmdline:
    parent = cmdline.read().split("\0")
print(f"standby_check rank={os.environ['RANK']} attempt={os.environ['TRAINYARD_ATTEMPT_NUMBER']} "
      f"in_standby={'node_agent.ranks.standby' in parent} torch_loaded={'torch' in sys.modules}", flush=True)
sys.argv = ["tiny_gpt", *sys.argv[1:]]
runpy.run_module("worker_runtime.examples.tiny_gpt", run_name="__main__", alter_sys=True)
