"""The rank shim: exact exit codes, signal forwarding, no orphaned worker, per-rank files."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from node_agent.ranks import shim as rank_shim
from tests.node_agent.helpers import REPO_ROOT, wait_for, write_script
from trainyard.protocol import agent as contract
from trainyard.protocol import env as protocol_env


@pytest.fixture
def spawned() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def start_shim(
    spawned: list[subprocess.Popen[bytes]], tmp_path: Path, *args: str, rank: int = 0
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        TRAINYARD_STATUS_DIR=str(tmp_path / "status"),
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(tmp_path)]),
        TRAINYARD_ATTEMPT_ID="shim-test",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "node_agent.ranks.shim", "--log-dir", str(tmp_path / "logs"), *args],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
    )
    spawned.append(proc)
    return proc


def rank_record(tmp_path: Path, rank: int = 0) -> dict[str, Any]:
    return json.loads((tmp_path / "status" / f"rank-{rank}.json").read_text())


def test_status_dir_name_is_the_contracts() -> None:
    assert rank_shim.ENV_STATUS_DIR is protocol_env.ENV_STATUS_DIR


def test_exit_code_and_output_are_recorded(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    script = write_script(
        tmp_path, "exit3.py", "import sys\nprint('out', sys.argv[1:])\nprint('err', file=sys.stderr)\nsys.exit(3)\n"
    )
    proc = start_shim(spawned, tmp_path, "file", str(script), "a", "--flag", rank=1)
    assert proc.wait(20) == 3
    record = rank_record(tmp_path, 1)
    assert record["state"] == "exited"
    assert record["exit_code"] == 3
    assert record["rank"] == 1 and record["local_rank"] == 1
    assert isinstance(record["pid"], int) and record["pid"] != proc.pid
    assert record["started_at"] and record["ended_at"]
    contract.WorkerStatus.model_validate(record)
    assert (tmp_path / "logs" / "rank-1" / "stdout.log").read_text() == "out ['a', '--flag']\n"
    assert (tmp_path / "logs" / "rank-1" / "stderr.log").read_text() == "err\n"


def test_sigkilled_worker_is_minus_nine(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    write_script(tmp_path, "selfkill.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    proc = start_shim(spawned, tmp_path, "module", "selfkill")
    assert proc.wait(20) == 128 + 9
    record = rank_record(tmp_path)
    assert record["state"] == "exited" and record["exit_code"] == -9


def _running_pid(tmp_path: Path) -> int:
    def ready() -> int | None:
        try:
            record = rank_record(tmp_path)
        except (OSError, ValueError):
            return None
        return record["pid"] if record["state"] == "running" and (tmp_path / "ready").exists() else None

    return int(wait_for(ready, what="the worker to run"))


SLEEPER = "import pathlib, time\npathlib.Path('ready').touch()\ntime.sleep(60)\n"


def test_sigterm_is_forwarded(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = start_shim(spawned, tmp_path, "file", "sleeper.py")
    worker = _running_pid(tmp_path)
    proc.send_signal(signal.SIGTERM)  # the shim alone, not its group
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert rank_record(tmp_path)["exit_code"] == -signal.SIGTERM
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_worker_dies_with_the_shim(tmp_path: Path, spawned: list[subprocess.Popen[bytes]]) -> None:
    write_script(tmp_path, "sleeper.py", SLEEPER)
    proc = start_shim(spawned, tmp_path, "file", "sleeper.py")
    worker = _running_pid(tmp_path)
    proc.kill()
    proc.wait(5)

    def gone() -> bool:
        try:
            return psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    wait_for(gone, timeout=5, what="the orphaned worker to die")


@pytest.mark.parametrize(("source", "kind", "said"), [
    ("import no_such_module_here\n", "start_error", "ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def main(:\n", "start_error", "SyntaxError"),
    ("def main():\n    raise ValueError('lr must be positive')\nmain()\n", "exception",
     "ValueError: lr must be positive (train.py line 2)"),
    # Issue 26: what a TrainLoop rank under torch.distributed prints: TrainLoop's line naming the
    # step, then torch's "[rank0]: " before every line of the traceback.
    ("import sys, traceback\ndef main():\n    raise ValueError('bad batch')\n"
     "try:\n    main()\nexcept ValueError:\n"
     "    print('trainyard: step 5 raised ValueError', file=sys.stderr, flush=True)\n"
     "    sys.stderr.write(''.join('[rank0]: ' + line for line in traceback.format_exc().splitlines(True)))\n"
     "    sys.exit(1)\n", "exception", "ValueError: bad batch (train.py line 3) in step 5"),
])
def test_a_failed_worker_is_classified_from_its_own_stderr(spawned, tmp_path: Path, source: str, kind: str,
                                                           said: str) -> None:
    (tmp_path / "train.py").write_text(source)
    proc = start_shim(spawned, tmp_path, "file", str(tmp_path / "train.py"))
    assert proc.wait(30) == 1
    record = rank_record(tmp_path)
    assert (record["state"], record["exit_code"], record["cause"]) == ("exited", 1, kind)
    assert said in record["message"]
    assert contract.WorkerStatus.model_validate(record).cause == kind


def test_a_missing_module_is_a_start_error(spawned, tmp_path: Path) -> None:
    proc = start_shim(spawned, tmp_path, "module", "no_such_entrypoint")
    assert proc.wait(30) == 1
    record = rank_record(tmp_path)
    assert (record["cause"], record["message"]) == ("start_error", "No module named no_such_entrypoint")


def test_the_job_env_reaches_the_training_process_only_and_never_a_reserved_name(capsys) -> None:
    """Finding 11: the job's env is applied by the shim to its child; PYTHONPATH is appended to the
    platform's, and names the platform keeps are left out even if a spec carried them."""
    job = {"FOO": "bar", "PYTHONPATH": "/job", "OMP_NUM_THREADS": "4", "LD_PRELOAD": "/x.so", "PET_NNODES": "9",
           "TRAINYARD_FENCING_TOKEN": "forged", "HOME": "/root"}
    platform = {"PYTHONPATH": "/repo:/cwd", "OMP_NUM_THREADS": "1", "HOME": "/w/home",
                "TRAINYARD_FENCING_TOKEN": "real", "TRAINYARD_JOB_ENV": json.dumps(job)}
    env = rank_shim.child_env(platform)
    assert "TRAINYARD_JOB_ENV" not in env
    assert env["FOO"] == "bar" and env["OMP_NUM_THREADS"] == "4"
    assert env["PYTHONPATH"] == "/repo:/cwd:/job"
    assert env["TRAINYARD_FENCING_TOKEN"] == "real" and env["HOME"] == "/w/home"
    assert "LD_PRELOAD" not in env and "PET_NNODES" not in env
    assert capsys.readouterr().err.count("left out") == 4
    assert rank_shim.child_env({"TRAINYARD_JOB_ENV": "[1]", "A": "b"}) == {"A": "b"}
