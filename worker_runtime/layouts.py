"""Apply the parallel layout a job asks for (trainyard/protocol/layout.py) to a model.

    parallel = apply_layout(model, ctx)           # ctx.layout, from TRAINYARD_LAYOUT
    with parallel.meter.step():
        for micro in range(parallel.accum_steps):
            with parallel.micro_step(micro):      # gradients synchronised on the last one only
                loss(parallel.module(x)).backward()
        optimizer.step()
    reporter.progress(step, loss, **parallel.meter.summary())

- ``ddp``: DistributedDataParallel with the layout's bucket size and a comm hook: plain
  all-reduce, bf16/fp16 compression, or PowerSGD (its state is per-rank training state:
  register ``parallel.extra_state``).
- ``fsdp``: FSDP2 (``fully_shard``) over a 1-D mesh of every rank: each block of the model (the
  members of its ModuleLists, unless ``units`` says otherwise), then the root.
- ``hsdp``: FSDP2 over a 2-D mesh (replicate, shard); the shard dimension is ``shard_size``
  consecutive ranks, by default the ranks of one node. Node ranks follow the control plane's
  order and torchrun numbers ranks node by node (node_agent/part/commands.py), so a shard group stays
  inside a node and only the replicas' all-reduce crosses nodes.
- ``tp_dp``: planned only; refused here with LayoutError.

Gradient accumulation: on every micro-step but the last, DDP runs under ``no_sync`` and FSDP2
with ``set_requires_gradient_sync(False)``: gradients accumulate locally and are reduced once.
Under FSDP2, ``compression`` bf16/fp16 is the reduce dtype of its mixed-precision policy.
Every collective of the step is metered (worker_runtime/comm_meter.py, comm_hooks.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainyard.protocol.layout import APPLIED_KINDS, Layout
from worker_runtime.comm_hooks import (
    MeteredAllGather,
    MeteredReduceScatter,
    PowerSGDStateful,
    ddp_hook,
    hsdp_all_reduce_hook,
)
from worker_runtime.comm_meter import CommMeter
from worker_runtime.context import WorkerContext
from worker_runtime.distributed import device_of, is_distributed, settle_ddp_buckets
from worker_runtime.state import Stateful


class LayoutError(ValueError):
    """The layout cannot be applied to this world (a planned-only kind, a shard size that does
    not divide the ranks, an option the kind does not support)."""


@dataclass(kw_only=True)
class ParallelModel:
    """A model wrapped for its layout, the meter of its collectives, and what a checkpoint must add."""

    layout: Layout
    module: nn.Module
    """Call this for the forward pass (the DDP wrapper, or the FSDP2-sharded model itself)."""
    model: nn.Module
    """The unwrapped model: register this in the TrainState, build the optimizer over it."""
    meter: CommMeter
    mesh: Any = None
    """The DeviceMesh of fsdp/hsdp, None otherwise."""
    extra_state: dict[str, Stateful] = field(default_factory=dict)
    """Per-rank state the layout keeps between steps (PowerSGD's); register it ``per_rank``."""

    @property
    def accum_steps(self) -> int:
        return self.layout.grad_accum_steps

    @property
    def sharded(self) -> bool:
        return self.mesh is not None

    @contextlib.contextmanager
    def micro_step(self, index: int) -> Iterator[None]:
        """Run one micro-step's forward and backward inside; gradients are synchronised only when
        ``index`` is the last micro-step of the optimizer step."""
        sync = index >= self.accum_steps - 1
        if self.sharded:
            self.module.set_requires_gradient_sync(sync)  # type: ignore[operator]
            yield
        elif not sync and hasattr(self.module, "no_sync"):
            with self.module.no_sync():  # type: ignore[operator]
                yield
        else:
            yield
        if sync:
            self.meter.sync_point()

    def settle(self, *example: torch.Tensor) -> None:
        """Before the first step (and after a restore's construction): let DDP rebuild its buckets
        (see settle_ddp_buckets). FSDP2 needs nothing."""
        if not self.sharded and self.module is not self.model:
            settle_ddp_buckets(self.module, *example)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: the members of every ModuleList (transformer blocks)."""
    return [member for module in model.modules() if isinstance(module, nn.ModuleList) for member in module]


def apply_layout(model: nn.Module, ctx: WorkerContext, layout: Layout | None = None, *,
                 units: Iterable[nn.Module] | None = None) -> ParallelModel:
    """Wrap ``model`` (already on its device) for ``layout`` (default ``ctx.layout``).

    Collective when distributed (meshes, DDP's initial broadcast): call it on every rank. A process
    without a process group trains the model as it is (accumulation still applies)."""
    layout = ctx.layout if layout is None else layout
    if layout.kind not in APPLIED_KINDS:
        raise LayoutError(f"layout {layout.kind!r} is planned only: the worker runtime applies "
                          f"{', '.join(sorted(APPLIED_KINDS))}")
    device = device_of(ctx)
    meter = CommMeter(device)
    if not is_distributed():
        return ParallelModel(layout=layout, module=model, model=model, meter=meter)
    if layout.kind == "ddp":
        return _ddp(model, ctx, layout, meter)
    return _fsdp(model, ctx, layout, meter, list(default_units(model) if units is None else units))


def _ddp(model: nn.Module, ctx: WorkerContext, layout: Layout, meter: CommMeter) -> ParallelModel:
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(
        model,
        device_ids=[ctx.local_rank] if ctx.device == "cuda" else None,
        bucket_cap_mb=layout.ddp_bucket_mb,
        gradient_as_bucket_view=True,
    )
    hook, hook_state = ddp_hook(meter, layout.compression, powersgd_rank=layout.powersgd_rank)
    ddp.register_comm_hook(hook_state, hook)
    extra: dict[str, Stateful] = {}
    if hook_state is not None:
        extra["powersgd"] = PowerSGDStateful(hook_state)
    return ParallelModel(layout=layout, module=ddp, model=model, meter=meter, extra_state=extra)


def mesh_shape(layout: Layout, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """The device mesh of an fsdp (1-D) or hsdp (replicate, shard) layout; LayoutError if the
    ranks do not split that way."""
    if layout.kind == "fsdp":
        return (world_size,)
    shard = layout.shard_size or local_world_size
    if world_size % shard:
        raise LayoutError(f"hsdp shard size {shard} does not divide the {world_size} ranks")
    return (world_size // shard, shard)


def _fsdp(model: nn.Module, ctx: WorkerContext, layout: Layout, meter: CommMeter,
          units: list[nn.Module]) -> ParallelModel:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    if layout.compression == "powersgd":
        raise LayoutError("PowerSGD compresses DDP's all-reduce; fsdp and hsdp take none, bf16 or fp16")
    shape = mesh_shape(layout, ctx.world_size, ctx.local_world_size)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh(ctx.device, shape, mesh_dim_names=names)
    reduce_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(layout.compression)
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    all_gather, reduce_scatter = MeteredAllGather(meter), MeteredReduceScatter(meter)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
            if len(shape) == 2:
                module.set_all_reduce_hook(hsdp_all_reduce_hook(meter, reduce_scatter))
    return ParallelModel(layout=layout, module=model, model=model, meter=meter, mesh=mesh)
