"""POST /v1/simulations: one long job on N nodes, its failures, saves, recoveries and spares."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

SIMULATION_EXAMPLE: dict[str, Any] = {
    "nodes": 2048, "node_mtbf_h": 6335, "work_h": 1296, "blocking_s": 6, "background_s": 150,
    "sync_blocking_s": 150, "recovery_s": 600, "spares": 8, "repair_h": 24,
}
MIN_NODE_MTBF_H = 1.0
"""A node that fails more often than hourly is not one to train on (and 5e-324 h divided by zero)."""
MAX_NODE_MTBF_H = 1e7


class SimulationIn(BaseModel):
    """The job and the cluster to simulate (control_plane/goodput/simulate.py; docs/goodput.md)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [SIMULATION_EXAMPLE]})

    # Each range is what a real cluster and job can have, and what the model computes on without
    # overflow or a division by zero (issue 28: four 500s came from values such as a node MTBF of
    # 5e-324 h; tests/control_plane/test_simulation_domain.py tries the whole of it).
    nodes: int = Field(ge=1, le=100_000, description="Nodes the job runs on, 1 to 100,000.")
    node_mtbf_h: float | None = Field(
        default=None, ge=MIN_NODE_MTBF_H, le=MAX_NODE_MTBF_H,
        description="Mean hours between failures of one node, 1 to 10,000,000 (a flaky node ~100, a good one "
                    "~50,000). Give it, or `interruptions` and `days`.")
    interruptions: int | None = Field(
        default=None, ge=1, le=10_000_000,
        description="Or: failures the job saw over `days` (e.g. 419), 1 to 10,000,000; the node MTBF they imply "
                    "(days x 24 x nodes / interruptions) must lie in node_mtbf_h's range.")
    days: float | None = Field(
        default=None, ge=0.01, le=3650,
        description="With `interruptions`: over how many days, 0.01 (about 15 minutes) to 3,650.")
    work_h: float = Field(default=720, ge=0.01, le=100_000,
                          description="Hours of training the job needs, 0.01 (36 s) to 100,000.")
    interval_s: float | None = Field(
        default=None, ge=1, le=1e7,  # below a second, work / interval overflows (a 500 schemathesis found)
        description="Seconds of compute between saves, 1 to 10,000,000; null: the best found around Young's.")
    blocking_s: float = Field(ge=0, le=86_400, description="Seconds one save blocks training, 0 to 86,400.")
    background_s: float = Field(
        default=0, ge=0, le=86_400,
        description="Seconds an asynchronous save uploads after that, 0 (synchronous) to 86,400.")
    sync_blocking_s: float | None = Field(
        default=None, ge=0, le=86_400,
        description="Seconds the same save blocks when synchronous, 0 to 86,400 (default blocking_s + background_s).")
    recovery_s: float = Field(default=600, ge=0, le=86_400,
                              description="Seconds from a failure to training again, a node at hand, 0 to 86,400.")
    spares: int | None = Field(default=None, ge=0, le=10_000,
                               description="Spare nodes, 0 to 10,000; null: a healthy node is always at hand.")
    repair_h: float = Field(default=24, ge=0, le=10_000,
                            description="Hours until a failed node is back, 0 to 10,000.")
    runs: int = Field(default=5, ge=1, le=50, description="Runs averaged (seeds seed, seed + 1, ...), 1 to 50.")
    seed: int = Field(default=0, ge=0, le=2**31, description="Seed of the first run, 0 to 2^31.")

    @field_validator("days")
    @classmethod
    def _implied_mtbf(cls, days: float | None, info: ValidationInfo) -> float | None:
        # The node MTBF that interruptions over days imply goes where node_mtbf_h goes: it has its range.
        nodes, interruptions = info.data.get("nodes"), info.data.get("interruptions")
        if days is None or nodes is None or interruptions is None:
            return days
        implied = days * 24 * nodes / interruptions
        if not MIN_NODE_MTBF_H <= implied <= MAX_NODE_MTBF_H:
            raise ValueError(f"{interruptions} interruptions over {days:g} days on {nodes} nodes mean a node fails "
                             f"every {implied:.3g} h; node_mtbf_h must be {MIN_NODE_MTBF_H:g} to {MAX_NODE_MTBF_H:g}")
        return days

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
