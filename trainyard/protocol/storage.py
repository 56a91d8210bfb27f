"""The storage seam of checkpoints: what an object store (S3 / MinIO / SeaweedFS) must offer
(standard library only).

Workers save shards through it and read manifests and shards back
(worker_runtime/checkpoint/, whose ``s3.S3Storage`` is the one implementation, shared with the
control plane); tests can use any object with these methods. Keys are ``/``-separated paths in
the bucket (trainyard.protocol.keys). Objects stream: shards of a large model never have to fit
in memory twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable


class ObjectNotFoundError(KeyError):
    """No object exists under the key."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    """Size in bytes."""
    etag: str | None = None
    """The store's content tag, when it gives one (for S3 the MD5 of single-part uploads)."""


@runtime_checkable
class CheckpointStorage(Protocol):
    """Blob storage for checkpoint shards and manifests.

    Implementations must make ``put_object`` atomic per object (a reader sees the old object, no
    object, or the whole new one, never a prefix): the two-phase commit relies on the commit
    marker appearing only once complete. They must be safe to call from several threads.
    """

    def put_object(self, key: str, data: BinaryIO, *, length: int | None = None) -> ObjectInfo:
        """Store the bytes read from ``data`` (until EOF, or ``length`` bytes) under ``key``.

        ``length`` lets a store upload in one request; without it, it may upload in parts.
        Overwrites an existing object.
        """
        ...

    def get_object(self, key: str) -> BinaryIO:
        """Open ``key`` for streaming reads; the caller closes the returned stream.

        Raises ObjectNotFoundError when there is no such object.
        """
        ...

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and tag of ``key``, or None when it does not exist."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing object is not an error (retries must be safe)."""
        ...


class Pace(Protocol):
    """How fast an upload may send (trainyard/storage/pacing.py: the rate of an upload slot)."""

    def take(self, n: int) -> None:
        """Block until ``n`` more bytes may be sent."""
        ...


@runtime_checkable
class PacedStorage(Protocol):
    """A store that can upload at a given pace (checkpoint upload slots, docs/architecture.md)."""

    def put_object_paced(self, key: str, data: BinaryIO, *, length: int, pace: Pace) -> ObjectInfo:
        """``put_object`` whose bytes leave no faster than ``pace`` lets them, in one request."""
        ...


__all__ = ["CheckpointStorage", "ObjectInfo", "ObjectNotFoundError", "Pace", "PacedStorage"]
