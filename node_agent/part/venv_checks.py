"""What root checks in a venv that an unprivileged uid built (node_agent/part/envs.py), without executing
anything in it, and how the tree is then made root's and read-only before any worker uses it.

The uid ran ``python -m venv`` (the node's own code) and then pip over the job's requirements (the
job's wheels). A wheel may ship any file into the venv: ``<name>.data/scripts/python`` replaces
``bin/python``, a ``.data/data`` entry rewrites ``pyvenv.cfg``. A venv whose interpreter links or
``pyvenv.cfg`` differ from what ``python -m venv`` made, or that holds anything but regular files,
directories and the links ``python -m venv`` made, or a hard link, or a setuid/setgid file, is
refused. Everything is inspected with lstat and
opened without following a link (safe_files); nothing is run.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from node_agent.confinement import safe_files

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


def _allowed_link(relpath: str, target: str) -> bool:
    """The only links ``python -m venv`` makes: bin/python* to the interpreter (their targets are
    compared by ``changed``) and lib64 to lib. pip makes none."""
    return (relpath.startswith("bin/python") and "/" not in relpath[4:]) or (relpath == "lib64" and target == "lib")


def seal(venv: Path, *, owner: int | None) -> int:
    """Give the tree to ``owner`` (root; None: leave owners as they are), readable and runnable by
    every user and writable by none but it; its size in bytes. Raises VenvTampered for a link other
    than the interpreter's and lib64, a special file, a hard link or a setuid/setgid file (after
    which nothing of it may be used). Walked by directory fds and changed through fds opened without
    following a link: a name swapped for a link meanwhile is never written through."""
    size = 0
    top = os.open(venv, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _fix(top, venv, ".", owner, is_dir=True)
        for directory, dirs, files, dir_fd in os.fwalk(venv, follow_symlinks=False):
            for name in (*dirs, *files):
                relpath = os.path.relpath(os.path.join(directory, name), venv)
                info = os.lstat(name, dir_fd=dir_fd)
                mode = info.st_mode
                if stat.S_ISLNK(mode):
                    if not _allowed_link(relpath, os.readlink(name, dir_fd=dir_fd)):
                        raise VenvTampered(f"the venv holds a link, {relpath}, that python -m venv did not make")
                    if owner is not None:
                        os.chown(name, owner, owner, dir_fd=dir_fd, follow_symlinks=False)
                    continue
                if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                    raise VenvTampered(f"the venv holds {relpath}, which is not a file or a directory")
                # O_PATH: nothing is opened for reading (a device's open has effects), no link followed.
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    size += _fix(fd, venv, relpath, owner, is_dir=stat.S_ISDIR(mode))
                finally:
                    os.close(fd)
    finally:
        os.close(top)
    return size


def _fix(fd: int, venv: Path, relpath: str, owner: int | None, *, is_dir: bool) -> int:
    """Check and seal the file or directory ``fd`` is (an O_PATH fd, or the top's); its size."""
    info = os.fstat(fd)
    mode = info.st_mode
    if is_dir != stat.S_ISDIR(mode) or not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise VenvTampered(f"the venv's {relpath} changed while it was sealed")
    if stat.S_ISREG(mode) and info.st_nlink > 1:
        # pip makes no hard links; one may be another file of the builder's, kept outside.
        raise VenvTampered(f"the venv holds a hard link, {relpath}")
    if mode & (stat.S_ISUID | stat.S_ISGID):
        raise VenvTampered(f"the venv holds a setuid or setgid file, {relpath}")
    # Through the fd's /proc entry: the very inode checked above, whatever its name leads to now.
    through = f"/proc/self/fd/{fd}"
    if owner is not None:
        os.chown(through, owner, owner)  # clears nothing we keep: no setuid bit is left
    os.chmod(through, 0o755 if stat.S_ISDIR(mode) or mode & stat.S_IXUSR else 0o644)
    return info.st_size
