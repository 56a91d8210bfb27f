"""A warm standby's earlier name: it is node_agent/ranks/standby.py, kept for an earlier agent that
still runs while its package is upgraded in place (node_agent/ranks/entry_points.py)."""

from node_agent.ranks.standby import main

if __name__ == "__main__":
    main()
