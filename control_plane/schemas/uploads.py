"""Response models of checkpoint upload slots (docs/architecture.md, "Checkpoint upload slots")."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class CheckpointUploadOut(BaseModel):
    """How a checkpoint's shards were uploaded, from what the ranks reported with their shards."""

    reported: int = Field(description="Shards whose upload figures were reported (older workers report none).")
    wait_s_max: float = Field(description="Longest time a rank waited for an upload slot.")
    wait_s_mean: float
    upload_s_max: float = Field(description="Longest upload, the wait not included.")
    bytes_per_s: float | None = Field(description="Bytes of the reported shards / the seconds their uploads took "
                                      "together: the rate one upload got on average.")
    bypassed: int = Field(description="Shards uploaded without a slot (a checkpoint.upload_unslotted event says why).")


class SlotLimitsOut(BaseModel):
    """The control plane's settings (0: unlimited)."""

    max: int = Field(description="TRAINYARD_UPLOAD_SLOTS_MAX: uploads in flight in the cluster.")
    per_label: int = Field(description="TRAINYARD_UPLOAD_SLOTS_PER_LABEL: uploads in flight per topology domain.")
    topology_label: str = Field(description="TRAINYARD_TOPOLOGY_LABEL: the node label naming a domain.")
    node_rate_bytes_per_s: int = Field(description="TRAINYARD_UPLOAD_NODE_RATE_BYTES_PER_S: a node's byte budget.")
    ttl_s: float = Field(description="TRAINYARD_UPLOAD_SLOT_TTL_S: the lease.")


class UploadSlotOut(BaseModel):
    id: str
    seq: int = Field(description="Arrival order: waiters are served oldest first.")
    job_id: str
    attempt_id: str
    node_id: str
    node_name: str
    label: str = Field(description="The node's topology domain ('' without the label).")
    rank: int
    step: int
    size_bytes: int
    state: str = Field(description="waiting | granted | released | expired")
    requested_at: datetime
    granted_at: datetime | None
    expires_at: datetime
    ended_at: datetime | None
    rate_bytes_per_s: int | None = Field(description="The pace granted; null: unpaced.")
    ok: bool | None = Field(description="Released: whether the upload succeeded.")
    uploaded_bytes: int | None
    upload_s: float | None


class UploadSlotsOut(BaseModel):
    limits: SlotLimitsOut
    granted: int = Field(description="Slots granted now, in the whole cluster.")
    waiting: int = Field(description="Slots waiting now, in the whole cluster.")
    slots: list[UploadSlotOut] = Field(description="The open slots, or with job_id every slot of that job "
                                       "(oldest first; ended slots are kept a day).")
