"""Talking to a running ``trainyard dev up`` through its data dir: ``trainyard dev node kill|restart``.

A request is a file ``DIR/control/<id>.request.json`` (``{"action", "node"}``); ``dev up`` polls
the folder, acts, and answers in ``<id>.answer.json`` (``{"ok", "message"}``), which the asking
command reads and removes. Files, not a socket: nothing to bind or clean up, and only who may
write the data dir (the user who runs ``dev up``) may ask.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ACTIONS = ("kill", "kill-workers", "restart")


class ControlError(RuntimeError):
    """The request could not be made or was refused (one line for the user)."""


def control_dir(data_dir: Path) -> Path:
    return data_dir / "control"


def _write(path: Path, payload: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh)
    os.replace(tmp, path)


def ask(data_dir: Path, action: str, node: str, timeout_s: float = 60.0) -> str:
    """Ask the ``dev up`` running on ``data_dir`` to act on ``node``; its answer, or ControlError."""
    if action not in ACTIONS:
        raise ControlError(f"unknown action {action!r}; expected one of {', '.join(ACTIONS)}")
    lock = data_dir / "dev-up.lock"
    if not lock.exists() or not lock.read_text().strip():
        raise ControlError(f"no 'trainyard dev up' runs on {data_dir} (start one, or pass its --data-dir)")
    folder = control_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    request_id = uuid.uuid4().hex
    _write(folder / f"{request_id}.request.json", {"action": action, "node": node})
    answer = folder / f"{request_id}.answer.json"
    deadline = time.monotonic() + timeout_s
    while not answer.exists():
        if time.monotonic() > deadline:
            (folder / f"{request_id}.request.json").unlink(missing_ok=True)
            raise ControlError(f"'trainyard dev up' on {data_dir} did not answer within {timeout_s:.0f}s")
        time.sleep(0.1)
    reply = json.loads(answer.read_text())
    answer.unlink(missing_ok=True)
    if not reply.get("ok"):
        raise ControlError(str(reply.get("message")))
    return str(reply.get("message"))


def serve_pending(data_dir: Path, handle: Callable[[str, str], str]) -> None:
    """Answer every request waiting in ``data_dir`` (``dev up``'s watch loop calls it); ``handle``
    returns the message or raises ControlError."""
    folder = control_dir(data_dir)
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.request.json")):
        request_id = path.name.split(".", 1)[0]
        try:
            request = json.loads(path.read_text())
            message = handle(str(request.get("action")), str(request.get("node")))
            reply: dict[str, object] = {"ok": True, "message": message}
        except ControlError as exc:
            reply = {"ok": False, "message": str(exc)}
        except (OSError, ValueError) as exc:
            reply = {"ok": False, "message": f"unreadable request: {exc}"}
        path.unlink(missing_ok=True)
        _write(folder / f"{request_id}.answer.json", reply)
