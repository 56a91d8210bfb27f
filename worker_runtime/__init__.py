"""The library a training script imports to run under Trainyard.

It reads who the process is (:class:`WorkerContext`), sets up torch.distributed for it, reports
progress and the result to the node agent, and gathers the loop's state for checkpoints. It
imports neither the control plane nor the agent; the wire contract it speaks (messages, env names,
the checkpoint key layout, the storage Protocol) is ``trainyard/protocol``, imported from there.

Importing the package does not import torch until a torch-backed name is used, so reading the
context stays cheap for launch shims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from worker_runtime.context import WorkerContext
from worker_runtime.reporting import Reporter, ReportError, StaleAttemptError

if TYPE_CHECKING:
    from worker_runtime.checkpoint.manager import CheckpointManager
    from worker_runtime.comm_meter import CommMeter
    from worker_runtime.data import ResumableSampler
    from worker_runtime.distributed import (
        device_of,
        init_distributed,
        is_distributed,
        settle_ddp_buckets,
        shutdown_distributed,
    )
    from worker_runtime.layouts import LayoutError, ParallelModel, apply_layout
    from worker_runtime.loop import TrainLoop
    from worker_runtime.restart import restartable, run_restartable
    from worker_runtime.state import (
        DataPosition,
        RngState,
        Stateful,
        StepCounter,
        TrainState,
        WorldSizeMismatchError,
        capture_rng_state,
        restore_rng_state,
        weights_sha256,
    )

_LAZY = {
    "CheckpointManager": "worker_runtime.checkpoint.manager",
    "ResumableSampler": "worker_runtime.data",
    "TrainLoop": "worker_runtime.loop",
    "restartable": "worker_runtime.restart",
    "run_restartable": "worker_runtime.restart",
    "CommMeter": "worker_runtime.comm_meter",
    "LayoutError": "worker_runtime.layouts",
    "ParallelModel": "worker_runtime.layouts",
    "apply_layout": "worker_runtime.layouts",
    "device_of": "worker_runtime.distributed",
    "init_distributed": "worker_runtime.distributed",
    "is_distributed": "worker_runtime.distributed",
    "settle_ddp_buckets": "worker_runtime.distributed",
    "shutdown_distributed": "worker_runtime.distributed",
    "DataPosition": "worker_runtime.state",
    "RngState": "worker_runtime.state",
    "Stateful": "worker_runtime.state",
    "StepCounter": "worker_runtime.state",
    "TrainState": "worker_runtime.state",
    "WorldSizeMismatchError": "worker_runtime.state",
    "capture_rng_state": "worker_runtime.state",
    "restore_rng_state": "worker_runtime.state",
    "weights_sha256": "worker_runtime.state",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'worker_runtime' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointManager",
    "CommMeter",
    "LayoutError",
    "ParallelModel",
    "DataPosition",
    "ReportError",
    "Reporter",
    "ResumableSampler",
    "RngState",
    "StaleAttemptError",
    "Stateful",
    "StepCounter",
    "TrainLoop",
    "TrainState",
    "WorkerContext",
    "WorldSizeMismatchError",
    "apply_layout",
    "capture_rng_state",
    "device_of",
    "init_distributed",
    "is_distributed",
    "restartable",
    "restore_rng_state",
    "run_restartable",
    "settle_ddp_buckets",
    "shutdown_distributed",
    "weights_sha256",
]
