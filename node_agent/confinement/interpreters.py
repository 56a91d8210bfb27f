"""Which interpreter a job may name as its ``python`` on this node (docs/security.md, "Interpreters
and venvs").

A job's interpreter is exec'd only after the confine wrapper (the agent's own interpreter,
confine_exec.py) has switched to the attempt's uid; but it runs torchrun and every worker, and it is
what a venv is built on, so it must be something the node's operator installed, never a file a job
(or any user) could have written. A path passes when it is the agent's own or the operator listed
it (``--allowed-python``, compared as named) or when root (or the agent's own user) owns the file and every
directory above it, none of them writable by group or others, both along the path as named and
along the path its links resolve to. Nothing here executes the file.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable

from trainyard.protocol.interpreters import python_path_problem

OPERATOR_HINT = ("install it root-owned (no directory above it writable by anyone but root), or list it with the "
                 "agent's --allowed-python")


def trusted_owners() -> frozenset[int]:
    """Who may own an interpreter and the directories above it: root, and the agent's own user
    (an agent that is not root runs every worker as itself anyway)."""
    return frozenset({0, os.geteuid()})


def _chain_problem(path: str, owners: frozenset[int]) -> str | None:
    """Why ``path`` (the file and each directory from / down to it) could have been written by
    someone other than ``owners``, or None. Links are not followed: the link itself is judged."""
    parts = path.strip("/").split("/")
    for depth in range(len(parts) + 1):
        current = "/" + "/".join(parts[:depth])
        try:
            info = os.lstat(current)
        except OSError as exc:
            return f"{current} cannot be inspected: {exc.strerror or exc}"
        is_last = depth == len(parts)
        if info.st_uid not in owners:
            return f"{current} is owned by uid {info.st_uid}, not root"
        if stat.S_ISLNK(info.st_mode):
            continue  # a link's own mode means nothing; who may replace it is its directory's mode
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{current} is writable by {'others' if info.st_mode & stat.S_IWOTH else 'its group'}"
        if is_last and not stat.S_ISREG(info.st_mode):
            return f"{current} is not a regular file"
    return None


def interpreter_problem(path: str, allowed: Iterable[str] = ()) -> str | None:
    """Why a job may not use ``path`` as its interpreter on this node (which rule failed and what the
    operator can do), or None."""
    refused = python_path_problem(path)
    if refused is not None:
        return refused
    real = os.path.realpath(path)
    if not os.path.isfile(real) or not os.access(real, os.X_OK):
        return f"the job's python {path} is not an executable file on this node"
    # As named, not as resolved: a listed path reached through a link someone else may swap is not it.
    if os.path.normpath(path) in {os.path.normpath(a) for a in (*allowed, sys.executable)}:
        return None
    owners = trusted_owners()
    # The path as named (a link in it could be swapped by whoever may write its directory), then
    # where it leads.
    why = _chain_problem(os.path.normpath(path), owners) or (None if real == path else _chain_problem(real, owners))
    if why is None:
        return None
    return f"the job's python {path} is not allowed on this node: {why}; {OPERATOR_HINT}"
