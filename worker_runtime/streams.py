"""The random streams a training step consumes: owned by the runtime, or named when they cannot be.

A resumed run is exact only if every draw after the restore is the draw the uninterrupted run made
(issue 24). The registered RNG state (worker_runtime.state.RngState) covers the process's global
streams; three things around the data loader draw from streams nobody registered, and this module
owns them:

- creating a DataLoader iterator draws its base seed from the loader's generator, or from the
  global torch stream when it has none. The loop creates an iterator at each epoch start and once
  more after a restore, so a resumed run's draw lands elsewhere in the global stream and every
  later dropout mask differs. :func:`quiet_iter` creates iterators without touching the global
  stream, and the loop's own loaders get a generator seeded from ``(seed, rank, epoch)`` only.
- DataLoader worker processes draw from streams seeded per worker at iterator creation: a worker
  has drawn for the samples it loaded before, and after a mid-epoch restore it has loaded fewer.
  :class:`SeededSamples` seeds a worker's streams (torch, Python, NumPy) from ``(seed, epoch,
  index)`` before each sample, so a sample's augmentation depends on nothing else: not the
  worker that loads it, the number of workers, or the start method.
- what the runtime cannot own it names: :class:`StreamWatch` looks, at the first save, for state
  that changed since the first step but is not registered (an optimizer, a scheduler, a GradScaler,
  an EMA copy of the weights, a generator), and for loaders it did not make; the loop reports each
  as a ``resume.inexact`` warning event (docs/writing-jobs.md, "What a resume restores").
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import random
import sys
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

INEXACT_EVENT = "resume.inexact"
"""The worker event kind (stored as ``worker.resume.inexact``) for a cause a resume cannot be exact."""


def mix(*parts: int) -> int:
    """A 63-bit seed from integers: distinct inputs give unrelated seeds (unlike a sum or a product)."""
    digest = hashlib.blake2b(b"".join(p.to_bytes(16, "little", signed=True) for p in parts), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def quiet_iter(data: Iterable[Any]) -> Iterator[Any]:
    """``iter(data)`` that leaves the global torch stream where it was (a DataLoader without a
    generator of its own draws its base seed from it)."""
    saved = torch.get_rng_state()
    try:
        return iter(data)
    finally:
        torch.set_rng_state(saved)


class SeededSamples(Dataset[Any]):
    """``dataset`` with each sample's randomness drawn from ``(seed, epoch, index)`` when a DataLoader
    worker loads it. The sampler hands it keys ``epoch * len(dataset) + index`` (the epoch travels
    with the index: persistent workers outlive an epoch). In the training process itself (no
    workers) the sample draws from the registered global streams, which a checkpoint restores."""

    def __init__(self, dataset: Dataset[Any], size: int, seed: int) -> None:
        self.dataset, self.size, self.seed = dataset, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: int) -> Any:
        epoch, index = divmod(int(key), self.size)
        if get_worker_info() is not None:
            seed_worker(mix(self.seed, epoch, index))
        return self.dataset[index]


def seed_worker(seed: int) -> None:
    """Seed the streams a DataLoader worker's sample code may draw from."""
    torch.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


@dataclass(frozen=True)
class Cause:
    """Why a resumed run may differ from the uninterrupted one."""

    kind: str
    what: str
    message: str


class StreamWatch:
    """State the runtime can see but does not own, fingerprinted at the first step and compared at
    the first save: what changed in between is state a checkpoint misses."""

    def __init__(self, registered: Iterable[Any], data: Iterable[Any], *, owned_loader: bool, device: str,
                 owned: Iterable[Any] = ()) -> None:
        self._registered = [*registered, *owned]
        self._data = data
        self._owned_loader = owned_loader
        self._device = device
        self._roots = _datasets(data)
        self._before = _fingerprints(self._registered, self._roots)

    def causes(self) -> list[Cause]:
        """Everything that keeps this run's resume from being exact, each named once."""
        found: list[Cause] = []
        data = self._data
        registered = {id(obj) for obj in self._registered}
        if not self._owned_loader and not any(id(d) in registered for d in [data, *self._roots]):
            found.append(Cause("data_position", type(data).__name__, (
                "the data does not come from loop.data_loader: its position is not in the checkpoint, so a "
                "resumed run reads other samples")))
        if not self._owned_loader and isinstance(data, DataLoader) and data.num_workers > 0:
            found.append(Cause("dataloader_workers", "DataLoader", (
                f"a DataLoader with num_workers={data.num_workers} not made by loop.data_loader: its workers' "
                "random streams are seeded at each iterator, which a resumed run creates elsewhere")))
        if self._device == "cuda" and not torch.are_deterministic_algorithms_enabled():
            found.append(Cause("nondeterministic_kernels", "cuda", (
                "torch.use_deterministic_algorithms is off: CUDA kernels (atomics in backward passes) may sum in "
                "another order after a resume")))
        after = _fingerprints(self._registered, self._roots)
        for key, (label, kind, value) in after.items():
            previous = self._before.get(key)
            if previous is not None and previous[2] != value:
                label = f"{label} held as {_holder(key, [*self._registered, *self._roots])}"
                found.append(Cause(kind, label, _UNREGISTERED[kind].format(label=label)))
        return found


def _holder(key: int, roots: list[Any]) -> str:
    """A name the object with id ``key`` is held under (an attribute or a global), for the message."""
    target = next((obj for obj in _visible(key, roots)), None)
    if target is None:
        return "?"
    for ref in gc.get_referrers(target):
        attributes = ref if isinstance(ref, dict) else getattr(ref, "__dict__", None)
        if isinstance(attributes, dict):
            names = [name for name, value in list(attributes.items()) if value is target and isinstance(name, str)]
            if names:
                module = attributes.get("__name__") if attributes is ref else None
                return f"{module}.{names[0]}" if isinstance(module, str) else repr(names[0])
    return "an unnamed reference"


def _datasets(data: Any) -> list[Any]:
    """The dataset behind ``data`` (a DataLoader's, unwrapped from SeededSamples)."""
    found: list[Any] = []
    dataset = getattr(data, "dataset", None)
    while dataset is not None and len(found) < 4:
        found.append(dataset)
        dataset = getattr(dataset, "dataset", None)
    return found


def _visible(key: int, roots: list[Any]) -> Iterator[Any]:
    for obj in gc.get_objects():
        if id(obj) == key:
            yield obj
        elif isinstance(obj, dict):
            yield from (v for v in list(obj.values()) if id(v) == key)
    for root in roots:
        yield from (v for v in list(getattr(root, "__dict__", {}).values()) if id(v) == key)


_UNREGISTERED = {
    "unregistered_module": ("{label} changed during training and is not registered (an EMA copy?): a resumed "
                            "run starts it from its initial value; loop.register it"),
    "unregistered_optimizer": "{label} holds state and is not registered: loop.register it",
    "unregistered_scheduler": "{label} advanced and is not registered: loop.register it",
    "unregistered_scaler": "{label} (a GradScaler) is not registered: loop.register it",
    "unregistered_generator": ("{label} was drawn from and is not registered: a resumed run draws other numbers; "
                               "register an object whose state_dict() is its get_state(), or derive the draws "
                               "from the step or the sample index"),
}


def _fingerprints(registered: list[Any], roots: list[Any]) -> dict[int, tuple[str, str, Any]]:
    """``id -> (label, kind, fingerprint)`` of the unregistered stateful objects alive now."""
    covered = {id(obj) for obj in registered}
    modules = [obj for obj in registered if isinstance(obj, torch.nn.Module)]
    for module in modules:
        covered.update(id(m) for m in module.modules())
    covered.update(_owned_generators())
    with warnings.catch_warnings():
        # isinstance() touches every live object, deprecated aliases (torch.distributed.reduce_op) too.
        warnings.simplefilter("ignore")
        return _scan(covered, [*registered, *roots])


def _scan(covered: set[int], roots: list[Any]) -> dict[int, tuple[str, str, Any]]:
    found: dict[int, tuple[str, str, Any]] = {}
    numpy = sys.modules.get("numpy")
    global_state = getattr(numpy.random.mtrand, "_rand", None) if numpy is not None else None
    objects = gc.get_objects()
    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    scheduler_type = torch.optim.lr_scheduler.LRScheduler
    scaler_types = tuple(t for t in (_attr("torch.amp", "GradScaler"), _attr("torch.cuda.amp", "GradScaler"))
                         if t is not None)
    children: set[int] = set()
    # The global stream (registered by RngState) and tempfile's names (drawn when the runtime writes
    # a temporary file) are not the step's.
    names = getattr(_attr("tempfile", "_name_sequence"), "__dict__", {})
    skip = {id(getattr(random, "_inst", None)), id(names.get("_rng"))}
    candidates: list[Any] = []
    holders: list[dict[str, Any]] = []
    for obj in objects:
        if isinstance(obj, module_type):
            candidates.append(obj)
            children.update(id(m) for m in obj.children())
        elif isinstance(obj, optimizer_type) and id(obj) not in covered:
            found[id(obj)] = (f"an optimizer ({type(obj).__name__})", "unregistered_optimizer", len(obj.state))
        elif isinstance(obj, scheduler_type) and id(obj) not in covered:
            found[id(obj)] = (f"an LR scheduler ({type(obj).__name__})", "unregistered_scheduler", obj.last_epoch)
        elif scaler_types and isinstance(obj, scaler_types) and id(obj) not in covered:
            found[id(obj)] = ("a GradScaler", "unregistered_scaler", repr(obj.state_dict()))
        elif isinstance(obj, dict):
            # Generators held by name (a global, an attribute) are the user's; one held only by a
            # library's bound method (a retry jitter, a temporary name) is not the step's.
            holders.append(obj)
    # Most instances keep their attributes without a dict object (Python 3.11): look into the ones
    # the step's generators live in, the dataset and the registered objects.
    for root in roots:
        with contextlib.suppress(TypeError):
            holders.append(vars(root))
    for holder in holders:
        # A snapshot: the runtime's threads (uploads, reports) change dicts meanwhile; list() of a
        # dict runs in C under the GIL, whole.
        for value in list(holder.values()):
            if id(value) in covered or id(value) in skip:
                continue
            if type(value) is torch.Generator:
                found[id(value)] = ("a torch.Generator", "unregistered_generator", bytes(value.get_state().numpy()))
            elif isinstance(value, random.Random) and type(value) is not random.SystemRandom:
                found[id(value)] = ("a random.Random", "unregistered_generator", value.getstate())
            elif numpy is not None and isinstance(value, numpy.random.Generator):
                found[id(value)] = ("a numpy Generator", "unregistered_generator", repr(value.bit_generator.state))
            elif numpy is not None and isinstance(value, numpy.random.RandomState) and value is not global_state:
                found[id(value)] = ("a numpy RandomState", "unregistered_generator",
                                    repr(value.get_state(legacy=False)))
    for module in candidates:
        if id(module) in covered or id(module) in children:
            continue  # a submodule is judged with its root
        if any(id(m) in covered for m in module.modules()):
            continue  # a wrapper (DDP, compile) of a registered module
        tensors = [*module.parameters(), *module.buffers()]
        if tensors:
            found[id(module)] = (f"a module ({type(module).__name__})", "unregistered_module",
                                 sum(t._version for t in tensors))
    return found


def _owned_generators() -> set[int]:
    owned = {id(torch.default_generator)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        owned.update(id(g) for g in torch.cuda.default_generators)
    return owned


def _attr(module: str, name: str) -> Any:
    loaded = sys.modules.get(module)
    return getattr(loaded, name, None) if loaded is not None else None
