"""The modules the agent starts processes by (``python -m MODULE``), and the names earlier agents
used for them.

A process keeps the command line it started with, and a process started by an earlier agent may
start more by the old name after an upgrade replaced the files: torchrun spawns its ranks as ``-m
node_agent.rank_shim`` once its rendezvous completes, which can be minutes after its agent started
it; an agent still running while its package is upgraded in place starts torchrun, standbys and
confine_exec.py by the names it imported with. So each old name is kept as a thin alias of the new
module (node_agent/rank_shim.py, torchrun_entry.py, standby.py, confine_exec.py), and whatever
recognises these processes by their command line (``started_as``: the dev cluster's
``kill-workers``, tests) accepts both names.

An agent that restarts adopts its parts without looking at command lines at all: by the part's
state file (pid and start time of its torchrun), its cgroup or uid, and the TRAINYARD_ATTEMPT_ID and
TRAINYARD_NODE_ID every process of the part inherits (part/attempt.py, ranks/processes.py,
ranks/orphans.py). A rename of these modules changes none of those.

Standard library only, no imports at all: the rank shim reads it.
"""

from __future__ import annotations

RANK_SHIM = "node_agent.ranks.shim"
TORCHRUN_ENTRY = "node_agent.ranks.torchrun_entry"
STANDBY = "node_agent.ranks.standby"

OLD_NAMES: dict[str, tuple[str, ...]] = {
    RANK_SHIM: ("node_agent.rank_shim",),
    TORCHRUN_ENTRY: ("node_agent.torchrun_entry",),
    STANDBY: ("node_agent.standby",),
}
"""Each module's earlier names: processes started by an earlier agent carry them."""


def names(module: str) -> tuple[str, ...]:
    """Every name ``module`` was started by: its own first, then its earlier ones."""
    return (module, *OLD_NAMES.get(module, ()))


def started_as(cmdline: list[str], module: str, *, within: int | None = None) -> bool:
    """True if ``cmdline`` runs ``module`` (``-m NAME``, NAME any of its names) within its first
    ``within`` words (None: anywhere, e.g. torchrun's entrypoint after its own options)."""
    words = cmdline if within is None else cmdline[:within]
    known = names(module)
    return any(word == "-m" and i + 1 < len(words) and words[i + 1] in known for i, word in enumerate(words))
