"""Pack a job file's ``workdir`` and upload it once per content hash (``trainyard run``).

The archive is a tar.gz of the folder's files, minus what its ``.gitignore`` and
``.trainyardignore`` files exclude (gitignore syntax; each applies below its own folder, as git
reads them, a folder's ``.trainyardignore`` after its ``.gitignore``, so ``!name`` there ships a
file git ignores) and ``.git`` itself. It is reproducible: entries sorted, times, owners and gzip
header zeroed, modes reduced to 0644/0755. So unchanged code has the same sha256, and ``GET
/v1/code/{sha256}`` tells that the control plane has it already.

Hash first: the sha256 of the last archive made of a workdir is kept in the user's cache
(``$XDG_CACHE_HOME/trainyard/code.json``) against a manifest of its files (path, size, mtime,
mode); while the manifest is unchanged, a submit asks the control plane for that sha256 without
packing anything. What it does is said on stderr: files, size, packed size, and the upload's
progress on a terminal.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trainyard.cli.api_client import Api, ApiError

MAX_FILES = 100_000
UPLOAD_CHUNK = 1 << 20
CACHE_ENTRIES = 64
IGNORE_FILES = (".gitignore", ".trainyardignore")
"""Files of ignore rules, in the order they apply in a folder."""
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
        for ignore in IGNORE_FILES:
            if ignore in names:
                rules.append((here, GitIgnoreSpec.from_lines((here / ignore).read_text(errors="replace")
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


def manifest(workdir: Path, files: list[Path]) -> str:
    """What decides the archive, cheaply: each file's path, size, mtime and whether it is executable."""
    digest = hashlib.sha256(b"trainyard-code-manifest-1\0")
    for relative in files:
        st = (workdir / relative).stat()
        digest.update(f"{relative.as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode & 0o111}\n".encode(
            "utf-8", "surrogateescape"))
    return digest.hexdigest()


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainyard" / "code.json"


def _cached(workdir: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(_cache_path().read_text()).get(str(workdir.resolve()))
    except (OSError, ValueError, AttributeError):
        return None
    return entry if isinstance(entry, dict) and entry.get("manifest") == key else None


def _remember(workdir: Path, entry: dict[str, Any]) -> None:
    """Keep the newest archive facts of at most CACHE_ENTRIES workdirs (best effort)."""
    path = _cache_path()
    try:
        known = json.loads(path.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known.pop(str(workdir.resolve()), None)
    known[str(workdir.resolve())] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(dict(list(known.items())[-CACHE_ENTRIES:])))
        os.replace(tmp, path)
    except OSError:
        pass


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def ship(api: Api, workdir: Path, tenant: str | None = None, *, say: Callable[[str], None] | None = None,
         progress: bool | None = None) -> dict[str, str]:
    """Pack and upload (unless it is there already) for the job's ``tenant``; the job body's ``code``.
    ``say`` gets what is done (default: stderr); ``progress``: the upload's percentage as it goes
    (default: when stderr is a terminal)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    progress = sys.stderr.isatty() if progress is None else progress
    files = files_of(workdir)
    key = manifest(workdir, files)
    size = sum((workdir / f).stat().st_size for f in files)
    known = _cached(workdir, key)
    if known is not None and _uploaded(api, known["sha256"], tenant):
        say(f"code: {workdir} unchanged ({len(files)} files, {_mb(size)}), sha256 {known['sha256'][:12]}: "
            "already on the control plane")
        return {"sha256": known["sha256"]}
    data = pack(workdir)
    sha256 = hashlib.sha256(data).hexdigest()
    _remember(workdir, {"manifest": key, "sha256": sha256, "bytes": len(data)})
    summary = f"code: {workdir}: {len(files)} files, {_mb(size)}, packed {_mb(len(data))}, sha256 {sha256[:12]}"
    if _uploaded(api, sha256, tenant):
        say(f"{summary}: already on the control plane")
        return {"sha256": sha256}
    say(f"{summary}: uploading")
    started = time.monotonic()
    _upload(api, sha256, data, tenant, say if progress else None)
    say(f"code: uploaded {_mb(len(data))} in {time.monotonic() - started:.1f}s")
    return {"sha256": sha256}


def _uploaded(api: Api, sha256: str, tenant: str | None) -> bool:
    try:
        api.get(f"/v1/code/{sha256}", tenant=tenant)
    except ApiError as exc:
        if exc.status != 404:
            raise
        return False
    return True


def _upload(api: Api, sha256: str, data: bytes, tenant: str | None, say: Callable[[str], None] | None) -> None:
    import httpx

    def chunks() -> Iterator[bytes]:
        shown = -1
        for start in range(0, len(data), UPLOAD_CHUNK):
            yield data[start:start + UPLOAD_CHUNK]
            percent = min(100, (start + UPLOAD_CHUNK) * 100 // max(len(data), 1))
            if say is not None and percent // 10 > shown // 10:
                shown = percent
                say(f"code: uploading {percent}% of {_mb(len(data))}")

    try:
        response = httpx.put(f"{api.url}/v1/code/{sha256}", content=chunks(), timeout=300.0,
                             params={"tenant": tenant} if tenant else None,
                             headers={**api.headers, "Content-Type": "application/octet-stream",
                                      "Content-Length": str(len(data))},
                             verify=api.verify)
    except httpx.HTTPError as err:
        raise api.unreachable(err, "cannot upload the workdir to") from err
    if response.status_code == 413:
        from trainyard.cli.api_client import problem_detail

        raise ApiError(f"the packed workdir is {_mb(len(data))}, over what the control plane takes for code "
                       f"({problem_detail(response)}); leave big files out with a .trainyardignore (gitignore "
                       "syntax) or ship data through storage, not code", 413)
    if response.status_code >= 400:
        from trainyard.cli.api_client import problem_detail

        raise ApiError(f"{response.status_code}: {problem_detail(response)}", response.status_code)
