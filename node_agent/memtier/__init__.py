"""The agent's side of the in-memory checkpoint tier: its budget and peers (tier.py), the shard
store (store.py), the workers' routes (local.py) and the peer port (peer.py)."""
