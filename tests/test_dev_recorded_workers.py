"""`trainyard dev node kill-workers` names warm workers from their rank files, which the job writes:
they are read as the agent reads them (trainyard/dev/processes.py, recorded_workers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from trainyard.dev.processes import recorded_workers


def test_rank_files_a_job_planted_neither_hang_nor_lead_elsewhere(tmp_path: Path) -> None:
    workers = tmp_path / "workers"
    status = workers / "part-a.0" / "status"
    status.mkdir(parents=True)
    # A live process stands in for the warm worker; pid 1 for the agent, whose cgroup is not ours.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (status / "rank-0.json").write_text(json.dumps({"pid": child.pid, "exit_code": None}))
        (status / "rank-1.json").write_text(json.dumps({"pid": 12345, "exit_code": 0}))  # ended
        os.mkfifo(status / "rank-2.json")  # opening it for reading would wait for a writer
        secret = tmp_path / "elsewhere.json"
        secret.write_text(json.dumps({"pid": 4242, "exit_code": None}))
        (status / "rank-3.json").symlink_to(secret)  # not followed
        (status / "rank-4.json").write_text(json.dumps({"pid": 4343, "exit_code": None, "pad": "x" * 100_000}))
        (status / "rank-5.json").write_text(json.dumps({"pid": True, "exit_code": None}))
        found: list[set[int]] = []
        reader = threading.Thread(target=lambda: found.append(recorded_workers(workers, agent=1)), daemon=True)
        reader.start()
        reader.join(10)
        assert not reader.is_alive(), "reading the job's rank files hung"
        assert found == [{child.pid}]
    finally:
        child.kill()
        child.wait()
