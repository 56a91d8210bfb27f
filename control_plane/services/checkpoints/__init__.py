"""Checkpoints: what a run saves, and the storage and links it saves through.

The two-phase commit, lineage, restore plans and retention (``checkpoints``); the in-memory tier's
peers, chosen at allocation (``memtier``), and what a worker says about it (``memtier_facts``,
pure); presigned storage grants (``storage_grants``) within their bounds (``storage_bounds``), and
the sweep of what no checkpoint owns (``storage_sweep``); upload slots on the shared links
(``upload_slots``) and their policy (``upload_policy``, pure).
"""
