"""A job that plants an interpreter (issue 23, finding 1): it writes an executable script at the
path it is given (in /dev/shm, which every uid may write) that would leave a mark with the uid that
ran it, then waits until that script is gone or WAIT_S seconds pass (default 120).

    planter_job.py /dev/shm/NAME [WAIT_S]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

planted = Path(sys.argv[1])
planted.write_text(f"#!/bin/sh\nid -u >> {planted}.ran\nexec {sys.executable} \"$@\"\n")
planted.chmod(0o755)
print(f"planted {planted} as uid {os.getuid()}", flush=True)
deadline = time.monotonic() + (float(sys.argv[2]) if len(sys.argv) > 2 else 120.0)
while planted.exists() and time.monotonic() < deadline:
    time.sleep(0.2)
