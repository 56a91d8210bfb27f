"""Response models of the nodes and cluster API."""

from __future__ import annotations

import re
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, field_validator

from control_plane.schemas.goodput import ClusterGoodputOut
from control_plane.schemas.scheduling import SchedulingOut

LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


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
    scheduling: str = Field(
        description="schedulable | cordoned | draining | drained: cordoned and draining nodes get no new "
        "work and their running jobs finish; a draining node with nothing left running is drained."
    )
    labels: dict[str, str] = Field(description="Effective labels: the agent's, overridden by the operator's.")
    label_overrides: dict[str, str] = Field(description="Labels the operator set (PUT .../labels).")
    last_heartbeat_at: datetime | None
    registered_at: datetime
    gpus: list[GpuOut]


class NodeLabelsIn(BaseModel):
    """The operator's labels of a node (replacing earlier ones), e.g. its rack."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"labels": {"rack": "r12"}}]})

    labels: dict[str, str] = Field(max_length=64)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not LABEL_KEY.match(key):
                raise ValueError(f"label name {key!r} must be 1-63 of A-Z a-z 0-9 . _ / - starting alphanumeric")
            if len(value) > 253 or any(c in value for c in "\0\n\r"):
                raise ValueError(f"label {key!r}: value must be at most 253 characters, no control characters")
        return v


class CapacityOut(BaseModel):
    nodes_total: int
    nodes_ready: int
    nodes_lost: int
    gpus_total: int
    gpus_allocatable: int = Field(description="GPUs on ready, schedulable nodes.")
    gpus_in_use: int
    gpus_free: int
    utilization: float = Field(description="Leased GPUs / allocatable GPUs.")
    gpus_releasing: int = Field(
        default=0, description="Leased GPUs of jobs that already ended: held until their node confirms its "
        "processes gone (a lost node: until it returns or is removed)."
    )


class QueuedJobOut(BaseModel):
    id: str
    name: str
    state: str
    gpus: int
    priority: int
    tenant: str
    position: int
    waiting_s: float


class ClusterOut(BaseModel):
    capacity: CapacityOut
    jobs_by_state: dict[str, int]
    queue: list[QueuedJobOut] = Field(description="Waiting jobs in service order (at the start of a pass).")
    scheduling: SchedulingOut = Field(description="Reservations and the recovery reserve, with their idle cost.")
    goodput: ClusterGoodputOut | None = Field(
        default=None, description="Every job's allocated GPU-time and what it bought, summed, with the GPU-time "
        "reservations and the recovery reserve held idle (docs/goodput.md).")
