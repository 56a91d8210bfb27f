"""Cluster: the nodes and their agents, and how the GPUs are shared.

Nodes: registration, heartbeats, liveness, removal (``nodes``); what an agent is told to run
(``specs``); one transaction-owning function per agent message (``agent_protocol``); the
scheduler's holds and their idle cost (``reservations``); the tenants' weights and quotas
(``tenants``).
"""
