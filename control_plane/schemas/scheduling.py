"""Response models of the scheduler's holds: reservations and the recovery reserve."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field


class ReservationOut(BaseModel):
    job_id: str
    job_name: str
    nodes: list[str] = Field(description="Names of the nodes held for the job.")
    earliest_start: datetime | None = Field(
        description="When the job fits there at the latest if running jobs end by their time limits; "
        "null: unknown (a job it waits for has no time limit)."
    )
    first_earliest_start: datetime | None = Field(description="The earliest start when the reservation was made.")
    held_gpus: int = Field(description="Free GPUs held idle for it now (backfill may still use them).")
    idle_gpu_seconds: float = Field(description="Idle GPU-seconds held for it so far: its cost.")
    since: datetime


class RecoveryReserveOut(BaseModel):
    gpu_kind: str
    nodes: list[str] = Field(description="Nodes kept for recovering jobs only.")
    idle_gpus: int = Field(description="Free GPUs on them now.")
    idle_gpu_seconds: float = Field(description="Idle GPU-seconds the reserve has cost so far.")
    recoveries_served: int = Field(description="Recovering jobs placed on reserve nodes so far.")


class SchedulingOut(BaseModel):
    reservations: list[ReservationOut] = Field(description="Active reservations, oldest first.")
    reservation_idle_gpu_seconds: float = Field(
        description="Idle GPU-seconds held by all reservations so far (ended ones included): their cost."
    )
    reservations_started: int = Field(description="Reserved jobs that started.")
    reservations_started_estimated: int = Field(
        default=0, description="Of those, the ones that were given an earliest start when they were reserved "
        "(none is given while every node they wait for runs a job without an ETA)."
    )
    reservations_started_on_time: int = Field(
        description="Of those, the ones that started no later than the earliest start first promised."
    )
    recovery_reserve: list[RecoveryReserveOut]
