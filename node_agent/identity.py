"""The node credential an agent keeps in its work dir across restarts.

A registration that presents the node's current credential is the same agent coming back (a
restart, a reboot with the work dir kept): the control plane lets it in at once, even while the
node still looks alive. Another instance with the same name (a second host, or this host with a
wiped work dir) has no such credential and is refused until the node is lost or removed
(409 node-name-in-use), so two agents with one name never take the node from each other in turns.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

FILE = "node-credential.json"


def load(work_dir: Path) -> str | None:
    """The credential of this work dir's last registration, or None (none yet, or unreadable)."""
    try:
        data = json.loads((work_dir / FILE).read_text())
    except (OSError, ValueError):
        return None
    token = data.get("node_token") if isinstance(data, dict) else None
    return token if isinstance(token, str) and token else None


def save(work_dir: Path, node_id: str, node_token: str) -> None:
    """Keep the credential, readable by this user only, replaced atomically. A failure to write
    costs only the fast path of the next restart."""
    path = work_dir / FILE
    tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"node_id": node_id, "node_token": node_token}, f)
        os.replace(tmp, path)
