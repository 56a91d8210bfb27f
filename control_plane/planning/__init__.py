"""The layout planner (docs/planner.md): memory per GPU, bytes per link class, step time and
throughput of each parallel layout on each GPU count, before a job starts.

Pure functions over the standard library and the wire contract (trainyard.protocol): the service
(control_plane/services/read/plans.py) reads the cluster and calls them; tests pin the formulas.
"""

from control_plane.planning.catalog import GPU_KINDS, find_gpu_kind, read_labels
from control_plane.planning.errors import PlanningError
from control_plane.planning.estimate import Memory, Row, estimate
from control_plane.planning.hardware import Hardware, HardwareOverrides, Link, resolve_hardware
from control_plane.planning.planner import (
    JobWarning,
    Plan,
    Recommendation,
    check_job,
    default_counts,
    default_layouts,
    job_counts,
    plan,
    plan_job,
)
from control_plane.planning.workload import BytesPerParam, TransformerShape, Workload, bytes_per_param

__all__ = [
    "GPU_KINDS", "BytesPerParam", "Hardware", "HardwareOverrides", "JobWarning", "Link", "Memory", "Plan",
    "PlanningError", "Recommendation", "Row", "TransformerShape", "Workload", "bytes_per_param", "check_job",
    "default_counts", "default_layouts", "estimate", "find_gpu_kind", "job_counts", "plan", "plan_job",
    "read_labels", "resolve_hardware",
]
