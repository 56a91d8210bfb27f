"""The parallel layout a job asks for, as the control plane stores it, the agent passes it on
(``TRAINYARD_LAYOUT``, JSON) and the worker runtime applies it; pydantic only.

The planner (control_plane/planning) predicts memory, bytes per link class and step time for a
layout; the worker runtime (worker_runtime/layouts.py) wraps the model to match and reports the
measured split under the metric names below, so that the job view can put prediction and
measurement side by side.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field

LayoutKind = Literal["ddp", "fsdp", "hsdp", "tp_dp"]
"""``ddp``: replicas, gradients all-reduced; ``fsdp``: FSDP2 full shard (ZeRO-3) over all ranks;
``hsdp``: shard inside a node, replicate across nodes (a 2-D device mesh, inner dimension inside
a node); ``tp_dp``: tensor parallel inside a node, data parallel across nodes (planned only, the
runtime does not apply it)."""

Compression = Literal["none", "bf16", "fp16", "powersgd"]
"""Gradient compression hook for DDP: none, cast to bf16/fp16 for the all-reduce, or PowerSGD."""

LAYOUT_KINDS: Final[tuple[str, ...]] = ("ddp", "fsdp", "hsdp", "tp_dp")
APPLIED_KINDS: Final[frozenset[str]] = frozenset({"ddp", "fsdp", "hsdp"})
"""The kinds the worker runtime applies; the others are planned only."""


class Layout(BaseModel):
    """How a job's ranks split the model and the batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: LayoutKind = "ddp"
    grad_accum_steps: int = Field(default=1, ge=1, le=4096, description=(
        "Micro-steps per optimizer step; gradients are synchronised only on the last one."))
    ddp_bucket_mb: float = Field(default=25.0, gt=0, le=4096,
                                 description="DDP gradient bucket size, MiB, over 0 to 4,096.")
    compression: Compression = Field(default="none", description="Gradient compression (DDP only).")
    powersgd_rank: int = Field(default=1, ge=1, le=64, description="PowerSGD matrix rank.")
    shard_size: int | None = Field(default=None, ge=1, le=4096, description=(
        "hsdp: ranks per shard group (default: the GPUs of one node)."))
    tp_size: int = Field(default=1, ge=1, le=64, description="tp_dp: tensor-parallel degree inside a node.")


METRIC_COMPUTE_S: Final = "compute_s"
"""Seconds per optimizer step spent outside collectives (mean over the reporting window)."""
METRIC_COMM_S: Final = "comm_s"
"""Seconds per optimizer step spent waiting in collectives (exposed, not overlapped)."""
METRIC_STEP_S: Final = "step_s"
"""Wall seconds per optimizer step."""
METRIC_COMM_BYTES: Final = "comm_bytes"
"""Bytes this rank passed to collectives per optimizer step."""
