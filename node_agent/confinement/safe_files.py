"""Read files that a worker wrote, as the agent, without being tricked by them.

A worker owns its directory (rank status, logs): any name in it may be a symlink to the agent's
secrets (/proc/1/environ), a FIFO that blocks the reader forever, or a hard link to another
attempt's file. The agent therefore walks from a directory it made itself, one component at a time,
never following a link (O_NOFOLLOW on each), opens without blocking, and accepts only a regular
file owned by the attempt's uid.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from pathlib import Path
from typing import Any

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafeFile(OSError):
    """The path is a link, not a regular file, or owned by someone else than the attempt."""


def _walk(root: Path, parts: tuple[str, ...]) -> int:
    """An fd of the directory root/parts (the caller closes it)."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts:
            if name in ("", ".", "..") or "/" in name:
                raise UnsafeFile(f"refusing path component {name!r}")
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(root: Path, *parts: str, owner: int | None = None) -> int:
    """An fd (read-only) of the regular file root/parts..., none of whose components below ``root``
    is a link; owned by ``owner`` when given. Raises OSError (UnsafeFile for a planted file)."""
    if not parts:
        raise UnsafeFile("no file named")
    directory = _walk(root, parts[:-1])
    try:
        if parts[-1] in ("", ".", "..") or "/" in parts[-1]:
            raise UnsafeFile(f"refusing file name {parts[-1]!r}")
        fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{'/'.join(parts)} is not a regular file")
        if owner is not None and info.st_uid != owner:
            raise UnsafeFile(f"{'/'.join(parts)} is owned by uid {info.st_uid}, not the attempt's {owner}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(root: Path, *parts: str, limit: int, owner: int | None = None) -> bytes:
    """At most ``limit`` bytes of root/parts... (see open_file); UnsafeFile when it is larger."""
    fd = open_file(root, *parts, owner=owner)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFile(f"{'/'.join(parts)} is larger than {limit} bytes")
    return data


def create_file(root: Path, *parts: str, data: bytes, mode: int) -> None:
    """Create root/parts... as a new regular file of ``mode`` holding ``data``, in a directory
    reached from ``root`` without following a link. Whatever is already there under that name (a
    link to /etc/shadow, a FIFO) is never opened: FileExistsError."""
    if not parts or parts[-1] in ("", ".", "..") or "/" in parts[-1]:
        raise UnsafeFile(f"refusing file name {parts[-1] if parts else ''!r}")
    directory = _walk(root, parts[:-1])
    try:
        # O_EXCL with O_CREAT fails on any existing name, a dangling link included.
        fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=directory)
    finally:
        os.close(directory)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def list_dir(root: Path, *parts: str) -> list[str]:
    """The names in root/parts (no link followed); [] when it cannot be read."""
    try:
        fd = _walk(root, parts)
    except OSError:
        return []
    try:
        return os.listdir(fd)
    except OSError:
        return []
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)


def write_private_json(path: Path, payload: dict[str, Any]) -> None:
    """Replace ``path`` atomically with ``payload`` as JSON, readable by this user only (0600)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w") as f:
            fd = -1
            json.dump(payload, f)
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
