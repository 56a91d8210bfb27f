"""The rank shim's earlier name: it is node_agent/ranks/shim.py. A torchrun an earlier agent started
starts its ranks as ``python -m node_agent.rank_shim`` (node_agent/ranks/entry_points.py)."""

from node_agent.ranks.shim import main

if __name__ == "__main__":
    main()
