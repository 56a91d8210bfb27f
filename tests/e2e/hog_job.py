"""A job that tries to take its node's memory or processes (issue 23, finding 6), run beside a victim
job on a dev cluster whose agents set small part limits: it should be stopped at its part's limit,
with the limit as its failure reason, and nothing outside its part should notice.

    hog_job.py memory      # allocates and touches 64 MiB blocks until something stops it
    hog_job.py forkbomb    # forks children that fork, until something stops it

Either way it runs at most 120 s and then exits 0: a hog that was not stopped makes its job succeed,
which the test reads as the attack getting through.
"""

from __future__ import annotations

import os
import sys
import time

what = sys.argv[1]
deadline = time.monotonic() + 120
print(f"hog: {what} as uid {os.getuid()}", flush=True)
if what == "memory":
    held = []
    while time.monotonic() < deadline:
        block = bytearray(64 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
        held.append(block)
elif what == "forkbomb":
    while time.monotonic() < deadline:
        try:
            if os.fork() == 0:
                time.sleep(0.05)  # then fork again, in the child's own loop
        except OSError:
            time.sleep(0.01)  # the part's pids.max: keep pushing, as a real fork bomb does
else:
    sys.exit(f"unknown hog {what!r}")
