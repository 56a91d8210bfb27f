"""The wire contract: what the control plane, the node agent and the worker runtime say to each
other, in one package all three import (docs/architecture.md, "Components and who talks to whom").

- ``agent``: the agent API's messages (control plane <-> agent) and the agent's local API
  (agent <-> workers); pydantic.
- ``env``: the TRAINYARD_* variables an agent gives its workers; standard library only.
- ``keys``: the object-key layout of checkpoints in S3; standard library only.
- ``layout``: the parallel layout a job asks for and the metric names of its measured split.
- ``memtier``: the in-memory checkpoint tier (worker -> agent -> peer agent).
- ``limits``: the bounds of every value that crosses into the control plane.
- ``storage``: the Protocol a checkpoint object store implements; standard library only.
- ``uploads``: checkpoint upload slots (worker -> agent -> control plane, a node's ranks in one
  batch) and a shard's upload figures.
- ``grants``: storage grants, presigned URLs for a worker's own checkpoint objects (worker -> agent
  -> control plane, a node's ranks in one batch).

Only the standard library and pydantic are imported here (an import-linter contract in
pyproject.toml checks it); this ``__init__`` imports nothing, so ``trainyard.protocol.env`` stays
cheap for the rank shim and the worker runtime.
"""
