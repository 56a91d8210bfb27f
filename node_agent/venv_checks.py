"""What root checks in a venv that an unprivileged uid built (node_agent/envs.py), without executing
anything in it, and how the tree is then made root's and read-only before any worker uses it.

The uid ran ``python -m venv`` (the node's own code) and then pip over the job's requirements (the
job's wheels). A wheel may ship any file into the venv: ``<name>.data/scripts/python`` replaces
``bin/python``, a ``.data/data`` entry rewrites ``pyvenv.cfg``. A venv whose interpreter links or
``pyvenv.cfg`` differ from what ``python -m venv`` made, or that holds anything but regular files,
directories and links, or a setuid/setgid file, is refused. Everything is inspected with lstat and
opened without following a link (safe_files); nothing is run.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from node_agent import safe_files

PYVENV_CFG_LIMIT = 64 * 1024


class VenvTampered(RuntimeError):
    """The venv is not what ``python -m venv`` made: refused (one line: why)."""


@dataclass(frozen=True)
class VenvShape:
    """What ``python -m venv`` made and nothing installed after it may change."""

    links: tuple[tuple[str, str], ...]
    """Each ``bin/python*`` and its link target."""
    pyvenv_cfg: bytes


def shape(venv: Path) -> VenvShape:
    """The interpreter links and ``pyvenv.cfg`` of a venv just made (raises VenvTampered when they
    are not links and a small regular file)."""
    links = []
    for name in sorted(safe_files.list_dir(venv, "bin")):
        if not name.startswith("python"):
            continue
        path = venv / "bin" / name
        if not path.is_symlink():
            raise VenvTampered(f"bin/{name} is not a link to the node's interpreter")
        links.append((name, os.readlink(path)))
    if not links:
        raise VenvTampered("the venv has no bin/python")
    try:
        cfg = safe_files.read_file(venv, "pyvenv.cfg", limit=PYVENV_CFG_LIMIT)
    except OSError as exc:
        raise VenvTampered(f"the venv's pyvenv.cfg cannot be read safely: {exc}") from exc
    return VenvShape(links=tuple(links), pyvenv_cfg=cfg)


def changed(before: VenvShape, venv: Path) -> str | None:
    """How the venv's interpreter links or pyvenv.cfg differ from ``before``, or None."""
    try:
        after = shape(venv)
    except VenvTampered as exc:
        return f"the job's requirements replaced the venv's interpreter or pyvenv.cfg: {exc}"
    if after.links != before.links:
        names = sorted({n for n, _ in before.links} ^ {n for n, _ in after.links}
                       | {n for (n, t) in before.links if (n, t) not in after.links})
        return f"the job's requirements replaced the venv's interpreter ({', '.join('bin/' + n for n in names)})"
    if after.pyvenv_cfg != before.pyvenv_cfg:
        return "the job's requirements rewrote the venv's pyvenv.cfg"
    return None


def seal(venv: Path, *, owner: int | None) -> int:
    """Give the tree to ``owner`` (root; None: leave owners as they are), readable and runnable by
    every user and writable by none but it; its size in bytes. Raises VenvTampered for a special file
    or a setuid/setgid one (after which nothing of it may be used). No link is followed."""
    size = 0
    for directory, dirs, files in os.walk(venv, followlinks=False):
        for name in (None, *dirs, *files):
            path = directory if name is None else os.path.join(directory, name)
            info = os.lstat(path)
            mode = info.st_mode
            if stat.S_ISLNK(mode):
                if owner is not None:
                    os.lchown(path, owner, owner)
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise VenvTampered(f"the venv holds {os.path.relpath(path, venv)}, which is not a file or a directory")
            if stat.S_ISREG(mode) and info.st_nlink > 1:
                # pip makes no hard links; one may be another file of the builder's, kept outside.
                raise VenvTampered(f"the venv holds a hard link, {os.path.relpath(path, venv)}")
            if mode & (stat.S_ISUID | stat.S_ISGID):
                raise VenvTampered(f"the venv holds a setuid or setgid file, {os.path.relpath(path, venv)}")
            if owner is not None:
                os.lchown(path, owner, owner)  # clears nothing we keep: no setuid bit is left
            # lstat said not a link, and the builder uid has no process left to swap one in.
            os.chmod(path, 0o755 if stat.S_ISDIR(mode) or mode & stat.S_IXUSR else 0o644)
            size += info.st_size
    return size
