"""Where checkpoints live in the bucket (standard library only).

    jobs/<job_id>/checkpoints                                    job_checkpoint_prefix
        /step-<step:09d>/attempt-<attempt:04d>                   step_prefix
            /rank-<rank:05d>.pt                                  shard_key (a worker writes it)
            /manifest.json                                       manifest_key (the commit writes it)

The control plane hands a job's prefix to its workers (LaunchSpec.storage["prefix"], then
TRAINYARD_CHECKPOINT_PREFIX), checks every reported shard key to be exactly shard_key, writes the
manifest under manifest_key and deletes a checkpoint by its step_prefix; workers save under
shard_key. Shards of one step from different attempts never share a key.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Final

MANIFEST_FORMAT: Final = "trainyard.checkpoint/1"
"""The ``format`` of a manifest (written by the control plane's commit, checked by workers)."""


def job_checkpoint_prefix(job_id: uuid.UUID | str) -> str:
    """The prefix of every checkpoint object of a job (no trailing slash)."""
    return f"jobs/{job_id}/checkpoints"


def step_prefix(prefix: str, step: int, attempt_number: int) -> str:
    """Where one attempt's objects of one step live, under a job's ``prefix`` (no trailing slash)."""
    return f"{prefix.strip('/')}/step-{step:09d}/attempt-{attempt_number:04d}"


def shard_key(prefix: str, step: int, attempt_number: int, rank: int) -> str:
    """The object key of one rank's shard of one step."""
    return f"{step_prefix(prefix, step, attempt_number)}/rank-{rank:05d}.pt"


def manifest_key(prefix: str, step: int, attempt_number: int) -> str:
    """The object key of a checkpoint's manifest: beside its shards."""
    return f"{step_prefix(prefix, step, attempt_number)}/manifest.json"


_OBJECT = re.compile(r"^step-(\d{9,})/attempt-(\d{4,})/(?:rank-(\d{5,})\.pt|manifest\.json)$")


@dataclass(frozen=True)
class CheckpointObject:
    """What a checkpoint object's key names (``parse_key``)."""

    step: int
    attempt_number: int
    rank: int | None
    """The shard's rank; None for the manifest."""


def parse_key(prefix: str, key: str) -> CheckpointObject | None:
    """The shard or manifest that ``key`` names under the job's ``prefix``, or None when it is not
    exactly such a key (as :func:`shard_key` and :func:`manifest_key` spell them: no ``..``, no
    other zero padding, nothing after)."""
    head = prefix.strip("/") + "/"
    if not key.startswith(head):
        return None
    match = _OBJECT.match(key[len(head):])
    if match is None:
        return None
    step, attempt = int(match[1]), int(match[2])
    rank = int(match[3]) if match[3] is not None else None
    canonical = manifest_key(prefix, step, attempt) if rank is None else shard_key(prefix, step, attempt, rank)
    return CheckpointObject(step, attempt, rank) if canonical == key else None
