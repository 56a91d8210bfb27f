"""Pack a job file's ``workdir`` and upload it once per content hash (``trainyard run``).

The archive is a tar.gz of the folder's files, minus what its ``.gitignore`` files exclude (each
applies below its own folder, as git reads them) and ``.git`` itself. It is reproducible: entries
sorted, times, owners and gzip header zeroed, modes reduced to 0644/0755. So unchanged code has the
same sha256, and ``GET /v1/code/{sha256}`` tells that the control plane has it already.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Any

from trainyard.api_client import Api, ApiError

MAX_FILES = 100_000
ALWAYS_LEFT_OUT = {".git", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}


def files_of(workdir: Path) -> list[Path]:
    """The files to ship, relative to ``workdir``, sorted."""
    from pathspec import GitIgnoreSpec

    if not workdir.is_dir():
        raise ApiError(f"workdir {workdir} is not a folder")
    rules: list[tuple[Path, Any]] = []
    found: list[Path] = []
    for root, dirs, names in os.walk(workdir):
        here = Path(root)
        if ".gitignore" in names:
            rules.append((here, GitIgnoreSpec.from_lines((here / ".gitignore").read_text(errors="replace")
                                                         .splitlines())))
        kept = []
        for d in sorted(dirs):
            if d not in ALWAYS_LEFT_OUT and not _ignored(here / d, rules, is_dir=True):
                kept.append(d)
        dirs[:] = kept
        for name in sorted(names):
            path = here / name
            if path.is_symlink() and not path.resolve().is_relative_to(workdir.resolve()):
                raise ApiError(f"{path} links out of the workdir; ship the file itself")
            if name.endswith(".pyc") or _ignored(path, rules, is_dir=False):
                continue
            found.append(path.relative_to(workdir))
            if len(found) > MAX_FILES:
                raise ApiError(f"workdir {workdir} has more than {MAX_FILES} files; list the big ones in .gitignore")
    return sorted(found)


def _ignored(path: Path, rules: list[tuple[Path, Any]], *, is_dir: bool) -> bool:
    ignored = False
    for base, spec in rules:
        if not path.is_relative_to(base):
            continue
        relative = path.relative_to(base).as_posix() + ("/" if is_dir else "")
        result = spec.check_file(relative)
        if result.include is not None:
            ignored = bool(result.include)
    return ignored


def pack(workdir: Path) -> bytes:
    """The reproducible tar.gz of the workdir's shipped files."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative in files_of(workdir):
            path = workdir / relative
            info = tarfile.TarInfo(relative.as_posix())
            data = path.read_bytes()
            info.size = len(data)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
        gz.write(raw.getvalue())
    return out.getvalue()


def ship(api: Api, workdir: Path, tenant: str | None = None) -> dict[str, str]:
    """Pack and upload (unless it is there already) for the job's ``tenant``; the job body's ``code``."""
    data = pack(workdir)
    sha256 = hashlib.sha256(data).hexdigest()
    try:
        api.get(f"/v1/code/{sha256}", tenant=tenant)
    except ApiError as exc:
        if exc.status != 404:
            raise
        import httpx

        try:
            response = httpx.put(f"{api.url}/v1/code/{sha256}", content=data, timeout=300.0,
                                 params={"tenant": tenant} if tenant else None,
                                 headers={**api.headers, "Content-Type": "application/octet-stream"},
                                 verify=api.verify)
        except httpx.HTTPError as err:
            raise api.unreachable(err, "cannot upload the workdir to") from err
        if response.status_code >= 400:
            from trainyard.api_client import problem_detail

            raise ApiError(f"{response.status_code}: {problem_detail(response)}", response.status_code) from exc
    return {"sha256": sha256}
