"""Pure scheduling policy: given the queue, the nodes and what runs on them, decide one pass.

No database, no clock, no I/O: ``decide`` is a function of its inputs, so its invariants are
property-tested (tests/control_plane/test_policy.py). ``allocate.py`` reads the inputs and applies
the decision in one transaction. docs/architecture.md ("Scheduling policy") is the long version:

- Order of service: recovering jobs (by priority and submit time), then priority, then the tenant's
  weighted share of GPUs in use (lowest first, updated as the pass admits jobs), then submit time.
- A job is admitted only as a whole gang that fits now and keeps its tenant within its quota.
- Placement is a function of capacities and demand, never of names or input order: a job that may
  use several GPU kinds goes to the kind with the most free capacity relative to the demand that
  may use it, then to the nodes where it destroys the least capacity the waiting shapes need (a
  small job fills a partly used node before it breaks a whole one); ties go by canonical ranks.
- The first ``max_reservations`` blocked jobs per GPU kind (recovering jobs always) get a
  reservation: the nodes where they fit soonest given the running jobs' time limits.
  Reservations share nodes: each holds its share from its earliest start for its job's time
  limit, and a later one is planned around the earlier ones (a small reservation does not keep a
  gang from reserving). A reservation is kept from pass to pass on the same nodes (its earliest
  start only moves earlier, unless what it waits for is released later than counted on) until its
  job starts. Other jobs use a reserved node's free GPUs only as backfill that ends before the
  earliest start, or beyond what the reservation needs at that time.
- A recovering job's healthy nodes (``prefer_nodes``) are held strictly: not even backfill.
- ``recovery_reserve`` nodes (per GPU kind) run recovering jobs only.
- Nothing running is ever touched: the policy only places waiting work.

The data types live in ``model.py`` (re-exported here); the pass itself, written for ~10^4
waiting jobs and ~10^3 nodes, in ``engine.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from control_plane.scheduler.engine import Pass
from control_plane.scheduler.model import (
    DEFAULT_TENANT,
    INF,
    MODES,
    PLACEMENT_RULES,
    WAIT_BEHIND,
    WAIT_CAPACITY,
    WAIT_NEVER,
    WAIT_QUOTA,
    WAIT_RESERVED,
    Decision,
    HeldNode,
    JobDemand,
    Mode,
    NodeCapacity,
    Placement,
    PlacementRule,
    PolicyOptions,
    Reservation,
    ReserveHold,
    Running,
    TenantShare,
)

__all__ = [
    "DEFAULT_TENANT", "INF", "MODES", "PLACEMENT_RULES", "WAIT_BEHIND", "WAIT_CAPACITY", "WAIT_NEVER", "WAIT_QUOTA",
    "WAIT_RESERVED", "Decision", "HeldNode", "JobDemand", "Mode", "NodeCapacity", "Placement", "PlacementRule",
    "PolicyOptions", "Reservation", "ReserveHold", "Running", "TenantShare", "decide", "place", "queue_order",
]

def queue_order(jobs: Iterable[JobDemand], tenants: Mapping[str, TenantShare] | None = None) -> list[JobDemand]:
    """The service order at the start of a pass (``decide`` updates shares as it admits jobs):
    recovering jobs first (they already held a place: by priority and submit time only), then
    priority, then the tenant's weighted share of GPUs in use, then submit time."""
    tenants = tenants or {}

    def share(j: JobDemand) -> float:
        if j.recovering:
            return 0.0
        s = tenants.get(j.tenant, DEFAULT_TENANT)
        return s.gpus_in_use / s.weight

    return sorted(jobs, key=lambda j: (not j.recovering, -j.priority, share(j), j.submitted_at, j.job_id))


def place(job: JobDemand, nodes: Sequence[NodeCapacity], *, topology_label: str | None = "rack") -> Placement | None:
    """Where ``job`` would go on these nodes now, ignoring reservations and quotas (or None)."""
    p = Pass([job], nodes, now=datetime.fromtimestamp(0, UTC), tenants={}, previous={},
              options=PolicyOptions(mode="greedy", topology_label=topology_label))
    return p.try_place(job, INF)


def decide(
    jobs: Iterable[JobDemand],
    nodes: Sequence[NodeCapacity],
    *,
    now: datetime,
    tenants: Mapping[str, TenantShare] | None = None,
    previous: Mapping[str, Sequence[str]] | None = None,
    options: PolicyOptions | None = None,
    previous_starts: Mapping[str, datetime | None] | None = None,
) -> Decision:
    """Decide one pass: whole-gang placements, reservations, the recovery reserve.

    ``previous`` maps the jobs that held a reservation after the last pass to its nodes, in the
    order the reservations were made: each is kept on those nodes while they can still hold it.
    ``previous_starts`` maps them to their earliest start after the last pass (None: unknown): a
    kept reservation starts from there and moves earlier only where that delays no other one (a
    reservation without one is planned again beside those kept before it).
    """
    return Pass(list(jobs), nodes, now=now, tenants=tenants or {}, previous=previous or {},
                options=options or PolicyOptions(), previous_starts=previous_starts).run()
