"""Where a rank is in a map-style dataset, as state a checkpoint saves: exact resume for free.

A resumed run reads exactly the samples the uninterrupted run would have read next only if the
order of samples is a function of what the checkpoint holds. :class:`ResumableSampler` makes it so:
each epoch's order is a permutation drawn from ``(seed, epoch)`` alone, split across ranks like
``DistributedSampler`` (rank r reads every world_size-th index from r), and its state is the epoch
and the number of samples this rank consumed in it. The training loop (worker_runtime.loop) counts
a batch as consumed when the step that used it is done, not when the DataLoader fetched it: a
DataLoader prefetches, so the sampler's own iteration runs ahead of the training.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data import Sampler

from worker_runtime.state import WorldSizeMismatchError


class ResumableSampler(Sampler[int]):
    """Indices of a map-style dataset of ``size`` samples for ``rank`` of ``world_size``.

    ``shuffle``: a new permutation each epoch from ``(seed, epoch)``; otherwise 0..size-1. Each
    rank gets ``size // world_size`` samples per epoch (the remainder is left out, as with
    ``drop_last``), so every rank runs the same number of steps.
    """

    VERSION: ClassVar[int] = 1

    def __init__(self, size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 keyed: bool = False) -> None:
        if size < world_size:
            raise ValueError(f"a dataset of {size} samples cannot feed {world_size} ranks")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.size, self.rank, self.world_size = size, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.keyed = keyed
        """Yield ``epoch * size + index`` instead of the index, for worker_runtime.streams.SeededSamples:
        a sample's randomness in a DataLoader worker is then drawn from its epoch and index alone."""
        self.epoch = 0
        self.consumed = 0
        """Samples this rank consumed in ``epoch`` (advanced by the loop after each step)."""

    @property
    def per_rank(self) -> int:
        return self.size // self.world_size

    def order(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch``, in the order they are read."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            everything = torch.randperm(self.size, generator=generator).tolist()
        else:
            everything = list(range(self.size))
        return everything[self.rank:self.per_rank * self.world_size:self.world_size]

    def __iter__(self) -> Iterator[int]:
        indices = self.order(self.epoch)[self.consumed:]
        if self.keyed:
            base = self.epoch * self.size
            return iter([base + index for index in indices])
        return iter(indices)

    def __len__(self) -> int:
        return self.per_rank - self.consumed

    def advance(self, samples: int) -> None:
        self.consumed += samples

    def next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.VERSION, "size": self.size, "world_size": self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        if state_dict.get("version") != self.VERSION:
            raise ValueError(f"sampler state version {state_dict.get('version')!r} is not {self.VERSION}")
        if int(state_dict["world_size"]) != self.world_size:
            raise WorldSizeMismatchError(
                f"the data position was saved with world_size={state_dict['world_size']} and this run has "
                f"{self.world_size}: the same position names other samples. Resume with the original world size.")
        saved = (int(state_dict["size"]), int(state_dict["seed"]), bool(state_dict["shuffle"]))
        if saved != (self.size, self.seed, self.shuffle):
            raise ValueError(f"the data position was saved for a dataset of {saved[0]} samples (seed {saved[1]}, "
                             f"shuffle {saved[2]}); this run has {self.size} (seed {self.seed}, shuffle "
                             f"{self.shuffle}): resuming would read other samples")
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])
