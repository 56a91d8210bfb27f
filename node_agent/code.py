"""A job's shipped code on this node: fetched once per content hash into the work dir's cache
(``work_dir/code/<sha256>.tar.gz``, checked against the hash the control plane gave), unpacked into
each attempt's own directory before launch (``<attempt dir>/code``: the workers' cwd, where the
entrypoint is resolved). Unpacked with tarfile's ``data`` filter: no absolute paths, no ``..``,
no links out of the folder, no device files."""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

from trainyard.protocol.agent import CodeRef


class CodeUnavailable(RuntimeError):
    """The code could not be fetched or is not what the control plane named (one line, reported as
    the part's launch error)."""


def cached_archive(work_dir: Path, ref: CodeRef, fetch: Callable[[], bytes]) -> Path:
    """The archive in the cache, fetched (and checked) if it is not there yet."""
    cache = work_dir / "code"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"{ref.sha256}.tar.gz"
    if path.exists() and _sha256(path) == ref.sha256:
        return path
    data = fetch()
    digest = hashlib.sha256(data).hexdigest()
    if digest != ref.sha256:
        raise CodeUnavailable(f"the job's code arrived with sha256 {digest}, not {ref.sha256}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path


def unpack(archive: Path, into: Path, *, uid: int | None = None, gid: int | None = None) -> Path:
    """Unpack ``archive`` into a new directory ``into``, owned by ``uid``/``gid`` when given (the
    attempt's: its workers run and read there, in a worker directory no other uid may enter)."""
    into.mkdir(mode=0o700, parents=True, exist_ok=False)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(into, filter="data")
        if uid is not None and gid is not None:
            # lchown: the "data" filter refuses links that leave the tree; none is followed anyway.
            os.lchown(into, uid, gid)
            for root, dirs, files in os.walk(into):
                for name in (*dirs, *files):
                    os.lchown(os.path.join(root, name), uid, gid)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CodeUnavailable(f"the job's code could not be unpacked: {exc}") from exc
    return into


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
