"""Checkpoints: the storage seam and the manager a training loop uses.

- this module: :class:`CheckpointStorage`, the Protocol an object store (S3 / MinIO / SeaweedFS)
  implements (defined by the wire contract, ``trainyard/protocol/storage.py``); tests can use any
  object with these methods. Imports no torch.
- ``trainyard/storage/s3.py`` (not here): :class:`S3Storage` (the MinIO SDK), shared with the control plane.
- ``manager``: :class:`CheckpointManager`, which saves a :class:`worker_runtime.state.TrainState`
  shard per rank and restores from the control plane's plan (two-phase checkpoints,
  docs/architecture.md); ``restore`` and ``notify`` are its parts.

Keys are ``/``-separated paths in the bucket, laid out by ``trainyard/protocol/keys.py``. Objects
stream: shards of a large model never have to fit in memory twice.
"""

from __future__ import annotations

# The storage Protocol is part of the wire contract (the control plane uses the same store).
from trainyard.protocol.storage import CheckpointStorage, ObjectInfo, ObjectNotFoundError

__all__ = ["CheckpointStorage", "ObjectInfo", "ObjectNotFoundError"]
