"""Response models of the nodes and cluster API."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class GpuOut(BaseModel):
    index: int
    uuid: str
    kind: str
    memory_mb: int
    job_id: str | None = Field(description="Job that leases this GPU, if any.")
    attempt_id: str | None


class NodeOut(BaseModel):
    id: str
    name: str
    address: str
    state: str = Field(description="ready | lost | removed")
    schedulable: bool
    labels: dict[str, str]
    last_heartbeat_at: datetime | None
    registered_at: datetime
    gpus: list[GpuOut]


class CapacityOut(BaseModel):
    nodes_total: int
    nodes_ready: int
    nodes_lost: int
    gpus_total: int
    gpus_allocatable: int = Field(description="GPUs on ready, schedulable nodes.")
    gpus_in_use: int
    gpus_free: int
    utilization: float = Field(description="Leased GPUs / allocatable GPUs.")


class QueuedJobOut(BaseModel):
    id: str
    name: str
    state: str
    gpus: int
    priority: int
    position: int
    waiting_s: float


class ClusterOut(BaseModel):
    capacity: CapacityOut
    jobs_by_state: dict[str, int]
    queue: list[QueuedJobOut]
