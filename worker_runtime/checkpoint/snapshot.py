"""The consistency point of an asynchronous save: a copy of the state in host memory.

The training loop is blocked only while every tensor is copied (to host memory; a CPU tensor is
cloned), the rest deep-copied; serialising, hashing and uploading then run in the background on the
copy, while the loop goes on changing the live state. So an asynchronous save costs the loop about
what a plain in-memory copy of the state costs (bench/checkpoint.py measures both), and the bytes
written are exactly those a synchronous ``torch.save`` at that step would have written.

Sharded state (a DTensor) is cloned where it lives: ``torch.save`` of the clone stores the rank's
local shard and its placement, as it does for the original.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def host_copy(obj: Any) -> Any:
    """A deep copy of a state dict (nested dicts, lists, tuples) whose tensors are in host memory."""
    if isinstance(obj, torch.Tensor):
        if _is_dtensor(obj):
            return obj.detach().clone()
        if obj.device.type == "cpu":
            return obj.detach().clone()
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, host_copy(v)) for k, v in obj.items()) if type(obj) is not dict else {
            k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(host_copy(v) for v in obj)
    return copy.deepcopy(obj)
