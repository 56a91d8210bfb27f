"""Goodput in the job view and the cluster view (docs/goodput.md)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class GoodputOut(BaseModel):
    """Allocated GPU-time and what it bought. GPU-seconds unless named otherwise; the components
    (productive ... other) add up to allocated_gpu_s."""

    goodput: float | None = Field(description="productive / allocated; null before any GPU was held.")
    allocated_gpu_s: float = Field(description="GPU-seconds the job's leases were held.")
    productive_gpu_s: float = Field(description="Steps that count: not recomputed later, checkpoint stalls excluded.")
    checkpoint_stall_gpu_s: float = Field(
        description="Training blocked by checkpoint saves (each save's slowest rank).")
    lost_work_gpu_s: float = Field(description="Steps computed again after a failure, and the steps in progress then.")
    recovery_gpu_s: float = Field(
        description="From a failure to the GPUs' release, and from the next allocation to its first step.")
    hung_gpu_s: float = Field(description="From the last step of an attempt failed as hung to the verdict.")
    startup_gpu_s: float = Field(description="First allocation to first step (start, load, first step).")
    other_gpu_s: float = Field(description="The rest: the final save and teardown, a cancel, time since the last step.")
    queueing_gpu_s: float = Field(description="Submit to first allocation, times the job's GPUs (not allocated).")
    steps_productive: int
    steps_lost: int = Field(description="Steps computed again after failures.")
    recoveries: int
    recovery_downtime_s: float = Field(description="Wall seconds from each failure to the next first step.")
    hung_s: float = Field(description="Wall seconds attempts spent hung before the verdict.")
    queued_s: float = Field(description="Wall seconds from submit to the first allocation.")


class ClusterGoodputOut(GoodputOut):
    """Every job's figures summed, and what the scheduler held idle on purpose."""

    jobs: int = Field(description="Jobs counted.")
    reservation_idle_gpu_s: float = Field(description="GPU-seconds reservations held idle for blocked jobs.")
    recovery_reserve_idle_gpu_s: float = Field(description="GPU-seconds the recovery reserve held idle.")
    computed_at: datetime


class StragglerOut(BaseModel):
    rank: int
    node: str = Field(description="The node the rank runs on: cordon it if it stays slow.")
    node_id: str
    busy_s: float = Field(description="The rank's compute seconds per step.")
    peers_busy_s: float = Field(description="The median of all ranks of the attempt.")
    ratio: float
    since: datetime = Field(description="Slower than the factor without a break since then.")
