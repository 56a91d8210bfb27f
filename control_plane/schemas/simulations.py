"""POST /v1/simulations: one long job on N nodes, its failures, saves, recoveries and spares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

SIMULATION_EXAMPLE: dict[str, Any] = {
    "nodes": 2048, "node_mtbf_h": 6335, "work_h": 1296, "blocking_s": 6, "background_s": 150,
    "sync_blocking_s": 150, "recovery_s": 600, "spares": 8, "repair_h": 24,
}


class SimulationIn(BaseModel):
    """The job and the cluster to simulate (control_plane/goodput/simulate.py; docs/goodput.md)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [SIMULATION_EXAMPLE]})

    nodes: int = Field(ge=1, le=100_000, description="Nodes the job runs on.")
    node_mtbf_h: float | None = Field(default=None, gt=0, le=1e7, description="Hours between failures of one node.")
    interruptions: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Or: failures the job saw over `days` (e.g. 419).")
    days: float | None = Field(default=None, gt=0, le=3650, description="With `interruptions`: over how many days.")
    work_h: float = Field(default=720, gt=0, le=100_000, description="Hours of training the job needs.")
    interval_s: float | None = Field(
        default=None, ge=1, le=1e7,  # below a second, work / interval overflows (a 500 schemathesis found)
        description="Compute between saves (at least 1 s); null: the best found around Young's.")
    blocking_s: float = Field(ge=0, le=86_400, description="Seconds one save blocks training.")
    background_s: float = Field(
        default=0, ge=0, le=86_400, description="Seconds an asynchronous save uploads after that (0: synchronous).")
    sync_blocking_s: float | None = Field(
        default=None, ge=0, le=86_400,
        description="What the same save blocks when synchronous (default blocking_s + background_s).")
    recovery_s: float = Field(default=600, ge=0, le=86_400, description="Failure to training again, a node at hand.")
    spares: int | None = Field(default=None, ge=0, le=10_000,
                               description="Spare nodes; null: a healthy node is always at hand.")
    repair_h: float = Field(default=24, ge=0, le=10_000, description="Hours until a failed node is back.")
    runs: int = Field(default=5, ge=1, le=50, description="Runs averaged (seeds seed, seed + 1, ...).")
    seed: int = Field(default=0, ge=0, le=2**31)

    @model_validator(mode="after")
    def _rate(self) -> SimulationIn:
        if (self.node_mtbf_h is None) == (self.interruptions is None):
            raise ValueError("give node_mtbf_h, or interruptions and days")
        if self.interruptions is not None and self.days is None:
            raise ValueError("interruptions needs days")
        return self

    @property
    def mtbf_h(self) -> float:
        if self.node_mtbf_h is not None:
            return self.node_mtbf_h
        assert self.interruptions is not None and self.days is not None
        return self.days * 24 * self.nodes / self.interruptions


class IntervalPoint(BaseModel):
    interval_s: float
    goodput: float


class SparesPoint(BaseModel):
    spares: int | None
    goodput: float
    waiting_h: float = Field(description="Hours waiting for a repaired node.")


class ModePoint(BaseModel):
    mode: str = Field(description="async or sync")
    blocking_s: float
    background_s: float
    interval_s: float = Field(description="The best interval for that mode.")
    goodput: float


class SimulationOut(BaseModel):
    node_mtbf_h: float
    job_mtbf_s: float = Field(description="The job's mean time between failures (node MTBF / nodes).")
    young_interval_s: float = Field(description="sqrt(2 x blocking x job MTBF): what the platform sets.")
    interval_s: float = Field(description="The interval simulated (given, or the best found).")
    best_interval_s: float
    goodput: float = Field(description="Useful training / wall time, mean of the runs.")
    goodput_closed_form: float | None = Field(
        description="The closed form for synchronous saves with a node at hand (null when it does not apply).")
    wall_h: float
    lost_work_h: float
    checkpoint_stall_h: float
    recovery_h: float
    waiting_h: float
    failures: int
    saves: int
    intervals: list[IntervalPoint]
    spares: list[SparesPoint]
    modes: list[ModePoint]
