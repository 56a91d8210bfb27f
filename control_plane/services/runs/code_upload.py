"""A code archive's upload, streamed (issue 23, finding 8; docs/security.md, "Storage bounds").

The body goes to S3 as it arrives, one part of ``PART_BYTES`` at a time, its sha256 computed on the
way: a replica holds at most about two parts per upload, not the archive (before, the whole body
was buffered, then copied). The object appears under its key only when the upload completes, after
the hash matched; anything else aborts it. Per tenant, archives are bounded in number and bytes
(``code_quota_archives``, ``code_quota_gb``); per principal, uploads in flight on one replica
(``code_uploads_per_principal``: 429 with Retry-After past it).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

from anyio import CancelScope, to_thread

from control_plane.authz import Principal
from control_plane.errors import Conflict, Unprocessable
from control_plane.services.access.gates import PrincipalGate
from control_plane.services.runs.code import code_key, find, owner_tenant, require_store
from control_plane.settings import Settings

PART_BYTES = 8 * 2**20
"""Bytes sent to S3 per part (S3's least is 5 MiB but for the last part)."""
GIB = 2**30


class CodeQuota(Conflict):
    """The tenant's code archives are at their quota."""

    slug = "code-quota"


class CodeQuotaBytes(CodeQuota):
    """The tenant's code archives would exceed their quota of bytes."""

    status = 413


class UploadGate(PrincipalGate):
    """Code uploads in flight, per principal, on this replica."""

    def __init__(self, per_principal: int) -> None:
        super().__init__(per_principal, what="code uploads in flight", setting="code_uploads_per_principal",
                         advice="retry when one has finished")


def declared_length(header: str | None) -> int | None:
    """A request's Content-Length, when it declares a usable one (BodyLimit refused a bad one)."""
    return int(header) if header is not None and header.isdigit() else None


def tenant_usage(store: Any, tenant: str) -> tuple[int, int]:
    """(archives, bytes) the tenant keeps."""
    sizes = [o.size for o in store.list_objects(code_key(tenant, "")[: -len(".tar.gz")])]
    return len(sizes), sum(sizes)


def check_quota(store: Any, tenant: str, adding: int, settings: Settings) -> int:
    """Raise unless one more archive of at least ``adding`` bytes fits; the bytes already used."""
    count, used = tenant_usage(store, tenant)
    if count + 1 > settings.code_quota_archives:
        raise CodeQuota(f"tenant {tenant} keeps {count} code archives, its quota (code_quota_archives="
                        f"{settings.code_quota_archives}); archives no job needs are deleted after "
                        f"code_unreferenced_days={settings.code_unreferenced_days:g}", quota="code_quota_archives",
                        limit=settings.code_quota_archives, used=count)
    _check_bytes(tenant, used, adding, settings)
    return used


def _check_bytes(tenant: str, used: int, adding: int, settings: Settings) -> None:
    limit = int(settings.code_quota_gb * GIB)
    if used + adding > limit:
        raise CodeQuotaBytes(f"tenant {tenant}'s code archives would take {used + adding} bytes (at least); its "
                             f"quota is {limit} bytes (code_quota_gb={settings.code_quota_gb:g})",
                             quota="code_quota_gb", limit=limit, used=used)


async def receive(store: Any, gate: UploadGate, principal: Principal, sha256: str, body: AsyncIterator[bytes], *,
                  declared: int | None, tenant: str | None, settings: Settings) -> tuple[dict[str, Any], bool]:
    """Stream an archive into storage under its hash for the caller's tenant (an admin's:
    ``tenant``); (its reference, whether it is new)."""
    owner = owner_tenant(principal, tenant)
    store = require_store(store)
    gate.acquire(principal.name)
    try:
        existing = await to_thread.run_sync(find, store, owner, sha256)
        used = 0 if existing else await to_thread.run_sync(check_quota, store, owner, declared or 0, settings)
        upload = None if existing else _Upload(store, code_key(owner, sha256))
        digest, size, head = hashlib.sha256(), 0, b""
        try:
            async for chunk in body:
                digest.update(chunk)
                size += len(chunk)
                if len(head) < 2:
                    head += chunk[:2]
                    if len(head) >= 2 and not head.startswith(b"\x1f\x8b"):
                        raise Unprocessable("the body is not a gzip archive (trainyard run packs a tar.gz)",
                                            field="body")
                if upload is not None:
                    _check_bytes(owner, used, size, settings)
                    await upload.add(chunk)
            if digest.hexdigest() != sha256:
                raise Unprocessable(f"the body's sha256 is {digest.hexdigest()}, not {sha256}: the upload was cut or "
                                    "changed", field="sha256")
            if not head.startswith(b"\x1f\x8b"):
                raise Unprocessable("the body is not a gzip archive (trainyard run packs a tar.gz)", field="body")
            if upload is not None:
                await upload.finish()
        except BaseException:
            if upload is not None:
                with CancelScope(shield=True):  # also when the client went away (a cancelled request)
                    await upload.abort()
            raise
    finally:
        gate.release(principal.name)
    if existing is not None:
        return existing, False
    return {"sha256": sha256, "size_bytes": size}, True


class _Upload:
    """Bytes to one object: buffered up to a part, then sent in parts (one PUT when it stays small)."""

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key
        self.buffer = bytearray()
        self.upload_id: str | None = None
        self.etags: list[str] = []

    async def add(self, chunk: bytes) -> None:
        self.buffer += chunk
        if len(self.buffer) >= PART_BYTES:
            await self._send(bytes(self.buffer[:PART_BYTES]))
            del self.buffer[:PART_BYTES]

    async def _send(self, part: bytes) -> None:
        if self.upload_id is None:
            self.upload_id = await to_thread.run_sync(self.store.start_upload, self.key)
        etag = await to_thread.run_sync(self.store.upload_part, self.key, self.upload_id, len(self.etags) + 1, part)
        self.etags.append(etag)

    async def finish(self) -> None:
        if self.upload_id is None:  # smaller than a part: one PUT
            data = bytes(self.buffer)
            await to_thread.run_sync(self.store.put_bytes, self.key, data)
            return
        if self.buffer:
            await self._send(bytes(self.buffer))
            self.buffer.clear()
        await to_thread.run_sync(self.store.complete_upload, self.key, self.upload_id, self.etags)

    async def abort(self) -> None:
        self.buffer.clear()
        if self.upload_id is not None:
            # S3 unreachable: its parts stay until an S3 lifecycle rule reaps them (docs/security.md).
            with contextlib.suppress(Exception):
                await to_thread.run_sync(self.store.abort_upload, self.key, self.upload_id)
