"""Why a worker process exited, from its exit code and the end of its own stderr (standard library
only: the rank shim classifies the exit of the worker it ran, and the control plane decides on it).

Kinds (``FAILURE_KINDS``):

- ``start_error``: the script never started: a syntax error, a missing module or file, an import
  that fails while the entrypoint is being loaded. Running it again cannot help, so the job fails
  at once instead of being retried ``max_failures`` times.
- ``out_of_memory``: a CUDA/torch out-of-memory error or Python's MemoryError.
- ``collective_timeout``: a collective or NCCL/gloo operation timed out or its peer went away
  (usually the consequence of another rank's failure: that rank ended first and is blamed).
- ``exception``: another uncaught Python exception; the message is its type and text, where it was
  raised and, when worker_runtime's TrainLoop ran it, the step (``... in step 5``: FAILED_STEP).
- ``signal``: killed by a signal (SIGKILL: the kernel's OOM killer or an operator).
- ``exit_code``: a non-zero exit without a traceback.
- ``resource_limit``: the part hit one of its resource limits (memory, pids, /dev/shm, work
  directory: node_agent/confinement/limits.py), named in the reason; the job's own, never the node's.
"""

from __future__ import annotations

import re
import signal

FAILURE_KINDS = ("start_error", "out_of_memory", "collective_timeout", "exception", "signal", "exit_code",
                 "node_lost", "launch_error", "time_limit", "other", "resource_limit")
"""What an attempt's failure_kind may be (the last four are decided by the control plane)."""

NODE_FAULT_KINDS = frozenset({"signal", "node_lost", "launch_error", "collective_timeout", "other"})
"""The failures a node may be blamed for (its processes killed, the node lost or its agent silent, a
peer unreachable, anything unexplained): a node blamed twice by one job is avoided for that job.
The others (start_error, exception, out_of_memory, exit_code, time_limit, resource_limit) are the job's own: they
would happen on any node, so they never count against the one they happened on."""

TAIL_BYTES = 16 * 1024
"""How much of a worker's stderr is read to classify its exit."""

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)(?:, in (?P<where>.+))?$')
_EXCEPTION = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Warning)|[A-Z]\w*Error)"
                        r"(?::\s?(?P<text>.*))?$")
# What the interpreter itself prints when it cannot load the entrypoint ("python: ..."), no traceback.
_NOT_STARTED = re.compile(r"^(?:\S*/)?python[\d.]*: (?P<what>can't open file .+|No module named .+|"
                          r"Error while finding module specification for .+)$")
_START_TYPES = ("SyntaxError", "IndentationError", "TabError", "ModuleNotFoundError", "ImportError")
_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|^MemoryError|out of memory", re.IGNORECASE)
_COLLECTIVE = re.compile(r"Watchdog caught collective operation timeout|Timed out waiting .* for (?:recv|send)|"
                         r"NCCL (?:error|timeout|communicator was aborted)|ncclSystemError|ncclInternalError|"
                         r"DistBackendError|Connection closed by peer|Connection reset by peer|"
                         r"collective operation timeout|ProcessGroup\w* .*timed out", re.IGNORECASE)
# torch.distributed prefixes what a rank prints once its process group exists ("[rank0]: Traceback").
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")
FAILED_STEP = re.compile(r"trainyard: step (?P<step>\d+) raised ")
"""The line worker_runtime.TrainLoop prints to stderr when an exception leaves a step (failed_step_line)."""
MAX_MESSAGE = 400


def failed_step_line(step: int, error: BaseException) -> str:
    """What TrainLoop prints before the traceback of an exception raised in ``step`` (FAILED_STEP)."""
    return f"trainyard: step {step} raised {type(error).__name__}"


def message_step(message: str) -> int | None:
    """The step a classified message names (``... in step N``), if any."""
    found = re.search(r" in step (\d+)$", message)
    return int(found.group(1)) if found else None


def is_collective_failure(message: str) -> bool:
    """Whether an error's text says a collective failed or a peer went away (not the rank's own bug)."""
    return bool(_COLLECTIVE.search(message))


def classify(exit_code: int, stderr_tail: str) -> tuple[str, str]:
    """(kind, message) of a worker's non-zero exit; the message quotes the worker's own words."""
    if exit_code < 0:
        name = _signal_name(-exit_code)
        why = " (the kernel's OOM killer, or an operator)" if -exit_code == signal.SIGKILL else ""
        return "signal", f"killed by {name}{why}"
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in stderr_tail.splitlines() if line.strip()]
    for line in reversed(lines[-20:]):
        found = _NOT_STARTED.match(line)
        if found:
            return "start_error", _cut(found.group("what"))
    error = _last_exception(lines)
    if error is None:
        return "exit_code", f"exited with code {exit_code}"
    kind_name, text, frames = error
    message = _cut(f"{kind_name}: {text}" if text else kind_name)
    where = f" ({frames[-1][0].rsplit('/', 1)[-1]} line {frames[-1][1]})" if frames else ""
    if kind_name.rsplit(".", 1)[-1] in _START_TYPES and all(w == "<module>" or "importlib" in f or "runpy" in f
                                                            for f, _, w in frames):
        # Raised while the entrypoint was being loaded (only module-level frames): not started.
        return "start_error", message + where
    if _OOM.search(message):
        return "out_of_memory", message + where
    if _COLLECTIVE.search(message) or any(_COLLECTIVE.search(line) for line in lines[-40:]):
        return "collective_timeout", message + where
    return "exception", message + where + _step_of(lines)


def _step_of(lines: list[str]) -> str:
    # TrainLoop prints its FAILED_STEP line just before the exception leaves the script, so the
    # last one before the last traceback is this exception's.
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=len(lines))
    for line in reversed(lines[:start]):
        found = FAILED_STEP.search(line)
        if found:
            return f" in step {found.group('step')}"
    # Once a process group exists, torch relays the rank's stderr with its "[rankN]: " prefix, and
    # under load the line can land after the traceback it came before (2 full runs in 3 saw it).
    for line in lines[start:]:
        found = FAILED_STEP.search(line)
        if found:
            return f" in step {found.group('step')}"
    return ""


def _last_exception(lines: list[str]) -> tuple[str, str, list[tuple[str, str, str]]] | None:
    """The last traceback's exception (type, text) and its frames (file, line, function)."""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")),
                default=None)
    region = lines[start:] if start is not None else lines[-6:]
    frames = [(m.group("file"), m.group("line"), m.group("where") or "<module>")
              for line in region if (m := _FRAME.match(line))]
    for line in reversed(region):
        found = _EXCEPTION.match(line.strip())
        if found and not line.startswith(" "):
            return found.group("type"), (found.group("text") or "").strip(), frames
    if start is None and not frames:
        return None
    # A SyntaxError prints the offending line and a caret after the frame; its last line is the type.
    return None


def _cut(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 3] + "..."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
