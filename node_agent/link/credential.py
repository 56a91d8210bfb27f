"""The node credential, kept in the agent's work dir (mode 0600) across restarts.

With it, a restarted agent registers its node again without a join token: join tokens expire or
are single-use, and a registered node is re-claimed only with its own credential or a join token
an operator bound to its name (control_plane/services/access/join_tokens.py). Workers never see it:
it is not in their environment, and i11's per-attempt users cannot read the work dir's files.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CREDENTIAL_FILE = "node-credential"


def load(work_dir: Path) -> str | None:
    try:
        value = (Path(work_dir) / CREDENTIAL_FILE).read_text().strip()
    except OSError:
        return None
    return value or None


def save(work_dir: Path, token: str) -> None:
    """Atomically, never readable by anyone else, even for a moment."""
    path = Path(work_dir) / CREDENTIAL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CREDENTIAL_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
