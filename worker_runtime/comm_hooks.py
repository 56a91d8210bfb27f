"""The collectives a layout issues, wrapped so that CommMeter sees each one: DDP comm hooks (plain,
bf16/fp16 compressed, PowerSGD), FSDP2's all-gather and reduce-scatter, and HSDP's all-reduce.

Nothing here changes what is computed: a wrapped hook calls the hook torch would have run, and
the FSDP2 comms call the same collectives as torch's defaults.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations against the real
# dist.GradBucket and Future[Tensor] classes, and string annotations fail that check.

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

# FSDP2's interfaces for custom collectives; FSDPModule.set_custom_all_gather/_reduce_scatter are
# public, the base classes are not exported under another name (torch 2.13).
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from worker_runtime.comm_meter import CommMeter, Marker

DdpHook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]


def metered_hook(meter: CommMeter, inner: DdpHook, inner_state: Any, *, wire_itemsize: int | None = None) -> DdpHook:
    """A DDP comm hook (a function: DDP reads its name and annotations) that runs ``inner`` and
    records its bucket as one asynchronous collective.

    Bytes are what goes on the wire per element: the bucket's size at its dtype, half of it for
    a bf16/fp16 cast, and PowerSGD's own count of the elements it all-reduced (its P and Q
    factors and the tensors it leaves uncompressed) once compression has started.
    """
    sgd = inner_state if isinstance(inner_state, powersgd.PowerSGDState) else None

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        nbytes = buffer.numel() * (wire_itemsize or buffer.element_size())
        before = sgd.total_numel_after_compression if sgd is not None else 0
        interval = meter.launched(0)
        future = inner(inner_state, bucket)
        if sgd is not None and sgd.total_numel_after_compression > before:
            nbytes = (sgd.total_numel_after_compression - before) * buffer.element_size()
        if interval is not None:
            interval.nbytes = nbytes

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            meter.completed(interval)
            return fut.value()

        return future.then(done)

    hook.__name__ = f"metered_{getattr(inner, '__name__', 'hook')}"
    return hook


def ddp_hook(meter: CommMeter, compression: str, *, powersgd_rank: int = 1) -> tuple[DdpHook, Any]:
    """The metered hook for a layout's ``compression`` and the state torch's hook needs (a
    PowerSGDState for ``powersgd``, which the checkpoint must save: see PowerSGDStateful)."""
    if compression == "none":
        return metered_hook(meter, default_hooks.allreduce_hook, None), None
    if compression in ("bf16", "fp16"):
        inner = default_hooks.bf16_compress_hook if compression == "bf16" else default_hooks.fp16_compress_hook
        return metered_hook(meter, inner, None, wire_itemsize=2), None
    if compression == "powersgd":
        # Vanilla all-reduce for the first step only: DDP has settled its buckets by then
        # (settle_ddp_buckets), the earliest PowerSGD allows with error feedback.
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                       start_powerSGD_iter=2, random_seed=0)
        return metered_hook(meter, powersgd.powerSGD_hook, state), state
    raise ValueError(f"unknown compression {compression!r}")


class PowerSGDStateful:
    """PowerSGD's state as checkpointable, per-rank state: its step, its RNG, and the error
    feedback and warm-start factors of every bucket. Without it a resumed run would restart
    compression from scratch and end with other weights than a run that never stopped."""

    def __init__(self, state: powersgd.PowerSGDState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        name, keys, pos, has_gauss, cached = self.state.rng.get_state(legacy=True)  # type: ignore[misc]
        return {
            "iter": self.state.iter,
            "rng": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "cached": float(cached)},
            "error": {int(k): v.detach().clone() for k, v in self.state.error_dict.items()},
            "p": {int(k): v.detach().clone() for k, v in self.state.p_memory_dict.items()},
            "q": {int(k): v.detach().clone() for k, v in self.state.q_memory_dict.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        rng = state_dict["rng"]
        keys = np.asarray(rng["keys"].numpy(), dtype=np.uint32)
        self.state.rng.set_state((rng["name"], keys, rng["pos"], rng["has_gauss"], rng["cached"]))
        self.state.iter = int(state_dict["iter"])
        for attr, key in (("error_dict", "error"), ("p_memory_dict", "p"), ("q_memory_dict", "q")):
            setattr(self.state, attr, {int(k): v.clone() for k, v in state_dict[key].items()})


class MeteredAllGather(AllGather):
    """FSDP2's all-gather (torch's default), timed; bytes: the gathered output."""

    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        with self.meter.blocking(output_tensor.numel() * output_tensor.element_size()):
            return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class MeteredReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter (torch's default), timed; bytes: the unsharded input. Remembers when
    the last one ended: HSDP's all-reduce across replicas follows it directly (see
    hsdp_all_reduce_hook). With a shard group of one rank FSDP2 copies instead of calling it, right
    after allocating the output: that allocation is the mark then."""

    def __init__(self, meter: CommMeter) -> None:
        self.meter = meter
        self.last_end: Marker | None = None

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.last_end = self.meter.mark()
        return torch.empty(tuple(size), dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        with self.meter.blocking(input_tensor.numel() * input_tensor.element_size()):
            work = dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                              async_op=async_op)
        self.last_end = self.meter.mark()
        return work


def hsdp_all_reduce_hook(meter: CommMeter, reduce_scatter: MeteredReduceScatter) -> Callable[[torch.Tensor], None]:
    """FSDP2 runs its all-reduce hook right after HSDP's all-reduce of a reduce-scatter's output
    (on that all-reduce's stream on GPU): the all-reduce is the span from the reduce-scatter's end
    to the hook. The hook changes nothing."""

    def hook(reduce_output: torch.Tensor) -> None:
        start = reduce_scatter.last_end
        if start is not None:
            meter.record(start, reduce_output.numel() * reduce_output.element_size())
            reduce_scatter.last_end = None

    return hook
