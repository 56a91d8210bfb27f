"""The agent's loops: heartbeat and desired state, supervision of its parts, status reports; and
the state they share (state.py)."""
