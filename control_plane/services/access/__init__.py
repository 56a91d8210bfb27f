"""Access: who may call, and how much each may hold at once.

Principals and their API tokens (``principals``); the dashboard's sessions (``ui_sessions``); the
join tokens an agent registers a node with (``join_tokens``); per-principal caps on one replica
(``gates``). Who may do what is control_plane/authz.py (pure).
"""
