"""What accelerators this node offers: NVIDIA GPUs found through NVML, or virtual CPU slots.

Both sources sit behind one Protocol so the agent neither knows nor cares which it has, except
for the device environment it gives workers (see launcher.device_env).
"""

from __future__ import annotations

from typing import Protocol

from trainyard.protocol.agent import GpuInfo

VIRTUAL_KIND = "virtual-cpu"


class NoGpusError(RuntimeError):
    """No NVIDIA GPU could be found and no virtual slots were asked for."""


class GpuSource(Protocol):
    virtual: bool

    def discover(self) -> list[GpuInfo]: ...


class VirtualGpus:
    """`count` CPU-only slots: lets a laptop or CI machine stand for a GPU node (gloo on CPU)."""

    virtual = True

    def __init__(self, count: int, node_name: str) -> None:
        if count < 0:
            raise ValueError("virtual GPU count must be >= 0")
        self.count = count
        self.node_name = node_name

    def discover(self) -> list[GpuInfo]:
        return [
            GpuInfo(index=i, uuid=f"virtual-{self.node_name}-{i}", kind=VIRTUAL_KIND, memory_mb=0)
            for i in range(self.count)
        ]


class NvmlGpus:
    """The node's NVIDIA GPUs, in NVML (= PCI bus) order; workers get CUDA_DEVICE_ORDER=PCI_BUS_ID
    so that these indices are also their CUDA ordinals."""

    virtual = False

    def discover(self) -> list[GpuInfo]:
        hint = "pass --virtual-gpus N to offer N CPU-only slots instead"
        try:
            # Imported here: nodes with virtual slots need neither the package nor a driver.
            import pynvml
        except ImportError as exc:
            raise NoGpusError(f"nvidia-ml-py is not installed ({exc}); {hint}") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NoGpusError(f"no NVIDIA driver/GPU found via NVML ({exc}); {hint}") from exc
        try:
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                gpus.append(
                    GpuInfo(
                        index=i,
                        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                        kind=_text(pynvml.nvmlDeviceGetName(handle)),
                        memory_mb=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024),
                    )
                )
        finally:
            pynvml.nvmlShutdown()
        if not gpus:
            raise NoGpusError(f"NVML reports no GPUs on this node; {hint}")
        return gpus


def _text(value: str | bytes) -> str:
    # Older NVML bindings return bytes.
    return value.decode() if isinstance(value, bytes) else value


def gpu_source(virtual: int | None, node_name: str) -> GpuSource:
    return NvmlGpus() if virtual is None else VirtualGpus(virtual, node_name)


def discover_gpus(virtual: int | None, node_name: str) -> list[GpuInfo]:
    """`virtual` slots if given, else the NVIDIA GPUs (NoGpusError when there are none)."""
    return gpu_source(virtual, node_name).discover()
