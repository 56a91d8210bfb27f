"""Request and response models of the tenants API."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

TENANT_NAME = r"^[a-z0-9][a-z0-9-]*$"


class TenantIn(BaseModel):
    """A tenant's share of the cluster. Omitted fields take their defaults."""

    model_config = ConfigDict(extra="forbid", strict=True,
                              json_schema_extra={"examples": [{"weight": 2, "gpu_quota": 64, "max_priority": 10}]})

    weight: float = Field(default=1.0, gt=0, le=1_000_000,
                          description="Over 0 to 1,000,000. Queue order uses GPUs in use / weight: a tenant of "
                          "weight 2 is served as if it used half its GPUs.")
    gpu_quota: int | None = Field(default=None, ge=0, le=10_000_000,
                                  description="Most GPUs its running jobs may hold together; null: no quota.")
    max_priority: int = Field(default=0, ge=-1000, le=1000,
                              description="Highest priority its members may give a job (admins may give any).")


class TenantOut(BaseModel):
    name: str
    weight: float
    gpu_quota: int | None
    max_priority: int
    configured: bool = Field(description="False: no row; the tenant has jobs and gets weight 1, no quota.")
    gpus_in_use: int
    weighted_share: float = Field(description="gpus_in_use / weight; the lowest is served first.")
    jobs_waiting: int
    jobs_running: int
