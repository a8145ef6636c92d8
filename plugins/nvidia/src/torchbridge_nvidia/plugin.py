"""Hook implementations of the NVIDIA plugin. Kept cheap to import: the entry point loads it,
and nothing here touches CUDA until a hook about a cuda device is called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel
    from torchbridge.backend import Backend
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass


def _mine(backend_name: str, device: torch.device) -> bool:
    return backend_name == "cuda" and device.type == "cuda"


@hookimpl
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge_nvidia.config import NVIDIAConfig

    return "nvidia", NVIDIAConfig

# Memory, synchronize and the rest come from the core's generic answers for torch.cuda/xpu.
GENERIC = ("generic",)


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_nvidia.probe import probe

    found = probe()
    return Detection("cuda", found.available, PRIORITY["cuda"], "cuda", found.device_count,
                     "NVIDIA", found.reason,
                     fallbacks=GENERIC)


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Backend
                            ) -> DeviceInfo | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_nvidia.devices import describe_device

    # The backend's section: hardware.nvidia.architecture fills in for a GPU the table does
    # not know here too, so autocast reads the same precision as the passes.
    return describe_device(device.index or 0, backend_name, backend.hardware_config)


@hookimpl
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_nvidia import probe

    index = device.index or 0
    free, total = probe.mem_get_info(index)
    return MemoryStats.from_caching_allocator(
        device, probe.allocator_counters(index), free, total,
        "free and total from cudaMemGetInfo (all processes)")


@hookimpl
def torchbridge_kernel_implementations() -> list[Any]:
    from torchbridge_nvidia.kernels import implementations

    return list(implementations())


@hookimpl
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "cuda":
        return None
    from torchbridge_nvidia.passes import nvidia_passes

    return nvidia_passes(backend)
