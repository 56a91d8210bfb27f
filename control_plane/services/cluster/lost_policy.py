"""How much longer a monitor waits before declaring nodes lost while heartbeats are queued (issue 27).

Pure: no database, no clock. mark_lost_nodes (services/cluster/nodes.py) applies it.

A heartbeat is recorded with the instant it *arrived* at its replica (the liveness lane stamps it:
control_plane/lanes.py), so a recorded heartbeat never looks older for having waited. One still
waiting is not recorded at all; until it is, the node's last record is one interval older than its
arrival. Two figures cover such heartbeats:

- ``local_oldest_s``: how long the oldest liveness request on this replica has been waiting. A heartbeat
  queued here arrived at most that long ago, so waiting that much longer than the lost timeout
  never declares its node lost (its previous one was at most an interval before it, and the
  lost timeout exceeds an interval).
- ``recent_lag_s``: the largest arrival-to-record lag any replica recorded recently (nodes.heartbeat_lag_s).
  A replica that is slow now was most likely slow a moment ago: its lag holds back every replica's
  monitor, not only its own.

Both are capped at ``cap_s`` (the lost timeout): a replica whose heartbeats wait longer than that is
broken, and nodes must still be declared lost in the end (within twice the lost timeout).
"""

from __future__ import annotations


def lost_grace_s(*, local_oldest_s: float, recent_lag_s: float | None, cap_s: float) -> float:
    """Seconds to add to every node's lost timeout for this sweep."""
    if cap_s <= 0:
        return 0.0
    lag = max(0.0, local_oldest_s, recent_lag_s or 0.0)
    return min(lag, cap_s)
