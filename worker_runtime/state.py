"""The complete state of a training loop, gathered in one place so it can be saved and resumed.

A checkpoint is only as good as what it captures: resuming must reproduce the uninterrupted run
bit for bit, which needs the model *and* the optimizer, the LR schedule, the position in the data,
the RNG streams and the step. The loop registers each of them, by name, in a :class:`TrainState`;
the checkpoint manager (a later module) saves and restores the registry without knowing the loop.

Everything a state_dict here returns is plain (tensors, numbers, strings, lists, dicts), so it
loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar, cast, runtime_checkable

import torch


@runtime_checkable
class Stateful(Protocol):
    """Anything with torch's state_dict()/load_state_dict() pair (modules, optimizers, ...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


S = TypeVar("S", bound=Stateful)


class TrainState:
    """A registry of the named stateful objects a training loop owns.

    ``per_rank`` marks state that differs between ranks (data position, RNG) and must be saved by
    every rank; the rest (a DDP model and its optimizer) is replicated and rank 0's copy suffices:
    only rank 0 saves it, and every rank restores it from rank 0's shard. State that holds DTensors
    (FSDP2, sharded state dicts) is each rank's own part, so every rank saves it (``shard_state_dict``).
    Register the unwrapped module (``ddp.module``) so checkpoints do not depend on the wrapper.
    """

    def __init__(self) -> None:
        self._objects: dict[str, Stateful] = {}
        self._per_rank: set[str] = set()
        self._optional: set[str] = set()

    def register(self, name: str, obj: S, *, per_rank: bool = False, optional: bool = False) -> S:
        """Add ``obj`` under ``name`` and return it, so registration can wrap construction.
        ``optional``: a checkpoint without it still loads (state a newer runtime adds to older ones)."""
        if not name or not name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"state name {name!r} must be alphanumeric (with _ or -)")
        if name in self._objects:
            raise ValueError(f"state {name!r} is already registered")
        if not isinstance(obj, Stateful):
            raise TypeError(f"{type(obj).__name__} has no state_dict()/load_state_dict()")
        self._objects[name] = obj
        if per_rank:
            self._per_rank.add(name)
        if optional:
            self._optional.add(name)
        return obj

    def __getitem__(self, name: str) -> Stateful:
        return self._objects[name]

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    def names(self, *, per_rank: bool | None = None) -> list[str]:
        """Registered names in registration order; filtered to per-rank or replicated state."""
        return [n for n in self._objects if per_rank is None or (n in self._per_rank) == per_rank]

    def shard_state_dict(self, rank: int) -> dict[str, Any]:
        """What ``rank`` saves: everything on rank 0; elsewhere per-rank and sharded state only."""
        state = self.state_dict()
        if rank == 0:
            return state
        return {name: sd for name, sd in state.items() if name in self._per_rank or holds_dtensor(sd)}

    def state_dict(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """``{name: obj.state_dict()}`` for ``names`` (all by default)."""
        selected = self.names() if names is None else list(names)
        return {name: self._objects[name].state_dict() for name in selected}

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Load each object's state, in registration order (a model before its optimizer).

        ``strict`` requires ``state`` to cover exactly the registered names: a checkpoint that
        lacks, say, the optimizer would silently resume a different run.
        """
        missing = [n for n in self._objects if n not in state and n not in self._optional]
        unexpected = [n for n in state if n not in self._objects]
        if strict and (missing or unexpected):
            raise KeyError(f"state mismatch: missing {missing}, unexpected {unexpected}")
        for name, obj in self._objects.items():
            if name in state:
                obj.load_state_dict(state[name])


def holds_dtensor(obj: Any) -> bool:
    """Whether a state dict (nested dicts, lists, tuples) holds a DTensor: state sharded over ranks.

    A DTensor exists only once its module is imported; importing it here would cost every worker
    half a second of startup for nothing."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and _holds(obj, module.DTensor)


def _holds(obj: Any, kind: type) -> bool:
    if isinstance(obj, kind):
        return True
    if isinstance(obj, Mapping):
        return any(_holds(v, kind) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds(v, kind) for v in obj)
    return False


@dataclass
class StepCounter:
    """The number of optimizer steps taken; the loop's notion of "where am I"."""

    value: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.value}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        self.value = int(state_dict["step"])


class WorldSizeMismatchError(ValueError):
    """Data state saved with one world size cannot position a run with another."""


@dataclass(kw_only=True)
class DataPosition:
    """Where every rank is in the data: ``offset`` batches consumed per rank in ``epoch``.

    Ranks advance in lockstep (one batch each per step), so one offset describes all of them, but
    only for the world size it was recorded under: with another world size the same offset means
    other samples, so loading refuses it instead of silently skipping or repeating data.
    """

    VERSION: ClassVar[int] = 1

    world_size: int
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.epoch < 0 or self.offset < 0:
            raise ValueError(f"invalid data position {self}")

    def advance(self, batches: int = 1) -> None:
        self.offset += batches

    def next_epoch(self) -> None:
        self.epoch += 1
        self.offset = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "offset": self.offset,
        }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        version = state_dict.get("version")
        if version != self.VERSION:
            raise ValueError(f"data position version {version!r} is not supported (expected {self.VERSION})")
        saved = int(state_dict["world_size"])
        if saved != self.world_size:
            raise WorldSizeMismatchError(
                f"data position was saved with world_size={saved} but this run has "
                f"world_size={self.world_size}; resuming would skip or repeat samples. "
                "Resume with the original world size."
            )
        self.epoch = int(state_dict["epoch"])
        self.offset = int(state_dict["offset"])


def capture_rng_state() -> dict[str, Any]:
    """Snapshot python ``random``, numpy's global RNG, torch's CPU and current CUDA generators.

    Only the current CUDA device is captured: each rank owns one GPU, and capturing all devices
    would initialise CUDA contexts on GPUs this rank never uses. A CPU worker, or one whose CUDA
    is not yet initialised (so its generator is untouched), records None for CUDA.
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": None,
        "torch": torch.get_rng_state(),
        "cuda": None,
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional for a worker
        np = None  # type: ignore[assignment]
    if np is not None:
        legacy = cast(tuple[str, Any, int, int, float], np.random.get_state(legacy=True))
        name, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {
            "bit_generator": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore a snapshot taken by :func:`capture_rng_state` (on the same rank)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if state.get("numpy") is not None:
        import numpy as np

        npy = state["numpy"]
        keys = np.asarray(npy["keys"].numpy(), dtype=np.uint32)
        np.random.set_state((npy["bit_generator"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None:
        if not torch.cuda.is_available():
            raise RuntimeError("the RNG state includes a CUDA generator but CUDA is not available")
        torch.cuda.set_rng_state(state["cuda"], torch.cuda.current_device())


class RngState:
    """The process's RNG streams as a registrable stateful object (register it per rank)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng_state()

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        restore_rng_state(state_dict)


def weights_sha256(module: torch.nn.Module) -> str:
    """Hex sha256 over the parameters in name order (bytes of contiguous CPU copies).

    Two runs that should be identical compare with this; tied parameters are counted once.
    Sharded parameters (FSDP2's DTensors) are gathered whole first: then it is a collective, to
    be called on every rank.
    """
    digest = hashlib.sha256()
    for _, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        data = param.detach()
        if holds_dtensor(data):
            data = data.full_tensor()  # type: ignore[attr-defined]
        # Viewed as bytes so every dtype hashes (numpy has no bfloat16).
        tensor = data.to("cpu").contiguous().reshape(-1)
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
