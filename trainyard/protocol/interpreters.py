"""Which interpreter a job may name as its ``python``: the part of the rule that can be known at submit.

The agent starts a job's interpreter only after its confine wrapper has switched to the attempt's
uid (node_agent/confinement/confine_exec.py), and only when its own rule allows the path (an operator's
``--allowed-python`` list, or a file that root owns and no one else can write, every directory above
it included: node_agent/confinement/interpreters.py). A path in a place every user can write (``/tmp``,
``/dev/shm``...) or a user's home can never pass that rule, so it is refused at submit already (a
422 naming the field) instead of failing on a node. Standard library only.
"""

from __future__ import annotations

import posixpath
from typing import Final

WRITABLE_PLACES: Final = ("/tmp", "/var/tmp", "/dev/shm", "/run/shm", "/run/user", "/home", "/proc", "/dev/mqueue")
"""Directories below which any user (or a job before this one) can place a file: never an interpreter."""


def python_path_problem(path: str) -> str | None:
    """Why ``path`` can never be a job's interpreter on any node, or None (the node decides the rest)."""
    if not path.startswith("/"):
        return f"python must be an absolute path, got {path!r}"
    if any(part in (".", "..") for part in path.split("/")):
        return f"python must be a plain absolute path without '.' or '..', got {path!r}"
    normal = posixpath.normpath(path)
    for place in WRITABLE_PLACES:
        if normal == place or normal.startswith(place + "/"):
            return (f"python {path!r} is below {place}, where any user or job can place a file; a job's interpreter "
                    "must be one the node's operator installed (root-owned, or listed with the agent's "
                    "--allowed-python)")
    return None
