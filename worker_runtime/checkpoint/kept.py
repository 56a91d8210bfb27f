"""A rank's latest saved state kept in its own process (host memory), for an in-process restart
(worker_runtime/restart.py): the restore of the next attempt reads it instead of storage when the
plan names exactly that save. Not the agent's memory tier (node_agent/memtier/tier.py,
worker_runtime/checkpoint/memtier.py), which holds shards in the agent, across processes."""

from __future__ import annotations

from typing import Any

from worker_runtime.checkpoint.snapshot import host_copy


class KeptSave:
    """This rank's latest saved state, kept in host memory beside the upload (one copy per rank).

    Only used for a restore whose planned checkpoint (step and the attempt that saved it), rank and
    world size are exactly the kept ones: the plan lists committed checkpoints only, so a kept save
    the plan names is the state that checkpoint holds, and every other rank restores the same step
    from storage.
    """

    def __init__(self) -> None:
        self.step: int | None = None
        self._key: tuple[int, int, int] | None = None
        self._state: dict[str, Any] | None = None

    def keep(self, step: int, *, attempt_number: int, rank: int, world_size: int, state: dict[str, Any]) -> None:
        """``state``: a host copy nobody else mutates (the saved one), saved by ``attempt_number``."""
        self.step, self._key, self._state = step, (attempt_number, rank, world_size), state

    def get(self, step: int, *, attempt_number: Any, rank: int, world_size: int) -> dict[str, Any] | None:
        """A fresh host copy of the kept state when it is exactly ``step`` as saved by ``attempt_number``
        (the plan's candidate says which attempt saved it), of ``rank`` in ``world_size``."""
        if self._state is None or self.step != step or self._key != (attempt_number, rank, world_size):
            return None

        # A copy: optimizers adopt the tensors they load, and update them in place afterwards.
        copied: dict[str, Any] = host_copy(self._state)
        return copied
