"""Exit classification (trainyard.protocol.exits) on what Python really prints (issue 13)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard.protocol.exits import classify

CASES = [
    ("import nonexistent_mod\n", "start_error", "ModuleNotFoundError: No module named 'nonexistent_mod' (t.py line 1)"),
    ("def f(:\n  pass\n", "start_error", "SyntaxError: invalid syntax (t.py line 1)"),
    ("from os import nothing_here\n", "start_error", "ImportError: cannot import name 'nothing_here'"),
    # An import inside a function ran after the script started: an exception like any other.
    ("def main():\n    import nonexistent_two\nmain()\n", "exception",
     "ModuleNotFoundError: No module named 'nonexistent_two' (t.py line 2)"),
    ("def main():\n    raise KeyError('batch')\nmain()\n", "exception", "KeyError: 'batch' (t.py line 2)"),
    ("raise MemoryError()\n", "out_of_memory", "MemoryError (t.py line 1)"),
    ("class OutOfMemoryError(RuntimeError): pass\n"
     "raise OutOfMemoryError('CUDA out of memory. Tried to allocate 2 GiB')\n",
     "out_of_memory", "CUDA out of memory"),
    ("raise RuntimeError('[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.2]:1234')\n",
     "collective_timeout", "Connection closed by peer"),
    ("import sys\nsys.exit(3)\n", "exit_code", "exited with code 3"),
]


@pytest.mark.parametrize(("source", "kind", "said"), CASES)
def test_python_failures_are_classified(tmp_path: Path, source: str, kind: str, said: str) -> None:
    script = tmp_path / "t.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0
    got_kind, message = classify(done.returncode, done.stderr)
    assert got_kind == kind and said in message, (got_kind, message, done.stderr)


def test_a_missing_file_or_module_is_a_start_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(tmp_path / "gone.py")], capture_output=True, text=True, timeout=30)
    assert classify(done.returncode, done.stderr)[0] == "start_error"
    assert "can't open file" in classify(done.returncode, done.stderr)[1]
    done = subprocess.run([sys.executable, "-m", "no_such_module_x"], capture_output=True, text=True, timeout=30)
    assert classify(done.returncode, done.stderr) == ("start_error", "No module named no_such_module_x")


def test_signals_name_themselves() -> None:
    assert classify(-signal.SIGKILL, "") == ("signal", "killed by SIGKILL (the kernel's OOM killer, or an operator)")
    assert classify(-signal.SIGSEGV, "whatever") == ("signal", "killed by SIGSEGV")


def test_an_exception_in_a_trainloop_step_under_torch_distributed_keeps_its_message_and_step(tmp_path: Path) -> None:
    # Issue 26: with a process group, torch prefixes the rank's stderr ("[rank0]: Traceback ..."),
    # which once hid the exception ("exited with code 1"); TrainLoop names the step that raised.
    import os
    import socket

    script = tmp_path / "t.py"
    script.write_text(
        "import torch\nfrom torch.utils.data import TensorDataset\nfrom worker_runtime import TrainLoop\n"
        "with TrainLoop(total_steps=10) as loop:\n"
        "    for step, (x,) in loop.steps(loop.data_loader(TensorDataset(torch.randn(32, 2)), batch_size=4)):\n"
        "        if step == 3:\n"
        "            raise ValueError('lr must be positive')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert "[rank0]: ValueError" in done.stderr  # the prefix is really there
    said = "ValueError: lr must be positive (t.py line 7) in step 3"
    assert classify(done.returncode, done.stderr) == ("exception", said)
