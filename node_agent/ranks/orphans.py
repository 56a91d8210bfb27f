"""Orphaned workers: processes of this node that no attempt of this agent instance owns.

Every process an agent starts carries TRAINYARD_NODE_ID and TRAINYARD_ATTEMPT_ID (part/commands.py).
An agent that registered finds the processes marked with its node's id whose attempt it did not adopt
from its work dir: workers of an earlier instance whose work dir was wiped, or of another agent
that ran under the same name and was fenced off. They are stopped (SIGTERM, SIGKILL after the
grace period) and reported as alive in every heartbeat until they are gone, so the control plane
keeps their GPUs leased until then; their attempts are never launched by this instance. The
table of processes, not the work dir, is what tells: the sweep runs right after each registration,
before the first heartbeat that follows it, and again with every supervision scan. The marker is the
node's id, which registration gives (by name, so a wiped work dir gets the same id back): names
repeat across clusters, and an agent must never stop another cluster's workers. Where attempts
run in cgroups (node_agent/confinement/cgroups.py), the node's cgroups not owned are orphans too, with every
process in them, markers or not; their cgroups are removed once empty.
"""

from __future__ import annotations

import signal
import time
from typing import Any

from node_agent.confinement import processes
from node_agent.confinement.cgroups import AttemptCgroup


class OrphanSweeper:
    def __init__(self, *, grace_s: float, log: Any) -> None:
        self.node_id: str | None = None
        """Set at registration; until then nothing is swept."""
        self.grace_s = grace_s
        self.log = log
        self._term_sent_at: dict[str, float] = {}
        self.alive: frozenset[str] = frozenset()
        """Attempts with orphaned processes left at the last sweep (reported as alive)."""

    def sweep(
        self, table: processes.ProcessTable, owned: set[str], cgroups: dict[str, AttemptCgroup] | None = None
    ) -> set[str]:
        """Signal this node's processes of attempts not in ``owned``; returns the attempts found for
        the first time. ``owned`` must be read after ``table`` was scanned (a launch in between
        then counts as owned). ``cgroups``: this node's attempt cgroups, by attempt id."""
        found: dict[str, tuple[set[int], set[int]]] = {}
        for attempt_id, cgroup in (cgroups or {}).items():
            if attempt_id in owned:
                continue
            pids = {pid for pid in cgroup.pids() if pid in table.started}
            if pids:
                found[attempt_id] = (pids, set())
            else:
                cgroup.remove()
        for (node, attempt_id), pids in table.by_node.items():
            if self.node_id is None or node != self.node_id or attempt_id in owned or not pids:
                continue
            # Children that scrubbed their environment share a process group with a marked process.
            pgids = {table.pgid_of[pid] for pid in pids if pid in table.pgid_of}
            members = set(pids).union(*(table.by_pgid.get(pgid, ()) for pgid in pgids))
            previous = found.get(attempt_id, (set(), set()))
            found[attempt_id] = (members | previous[0], pgids | previous[1])
        now = time.monotonic()
        new = set(found) - set(self._term_sent_at)
        for attempt_id, (members, pgids) in sorted(found.items()):
            if attempt_id in new:
                self.log.warning(
                    "orphaned_workers_stopping", attempt_id=attempt_id, pids=sorted(members),
                    reason="processes of this node that no attempt of this agent instance owns "
                    "(a previous instance's, or another agent's with this node name)",
                )
                self._term_sent_at[attempt_id] = now
                processes.signal_processes(members, pgids, signal.SIGTERM)
            elif now - self._term_sent_at[attempt_id] >= self.grace_s:
                processes.signal_processes(members, pgids, signal.SIGKILL)  # repeated: they may fork
        for attempt_id in set(self._term_sent_at) - set(found):
            self.log.info("orphaned_workers_gone", attempt_id=attempt_id)
            del self._term_sent_at[attempt_id]
        self.alive = frozenset(found)
        return new
