"""Hook implementations of the AMD plugin. Kept cheap to import: the entry point loads it,
and nothing here touches HIP until a hook about a rocm device is called."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel
    from torchbridge.backend import Backend
    from torchbridge.kernels.implementations import KernelImplementation
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

logger = logging.getLogger("torchbridge.amd")
# Synchronize, empty_cache and reset_peak come from the core's generic answers for torch.cuda.
GENERIC = ("generic",)


def _mine(backend_name: str, device: torch.device) -> bool:
    return backend_name == "rocm" and device.type == "cuda"  # ROCm devices are torch "cuda"


@hookimpl
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge_amd.config import AMDConfig

    return "amd", AMDConfig


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_amd.probe import probe

    found = probe()
    return Detection("rocm", found.available, PRIORITY["rocm"], "cuda", found.device_count,
                     "AMD", found.reason,
                     fallbacks=GENERIC)


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Backend
                            ) -> DeviceInfo | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_amd.devices import describe_device

    return describe_device(device.index or 0, backend_name, backend.hardware_config)


@hookimpl
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_amd import probe

    index = device.index or 0
    free, total = probe.mem_get_info(index)
    return MemoryStats.from_caching_allocator(
        device, probe.allocator_counters(index), free, total,
        "free and total from hipMemGetInfo (all processes)")


@hookimpl
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    # torch's "nccl" process group is RCCL on a ROCm build; a build without it has none.
    if not _mine(backend_name, device):
        return None
    import torch.distributed as dist

    return "nccl" if dist.is_available() and dist.is_nccl_available() else None


@hookimpl
def torchbridge_backend_created(backend: Backend) -> None:
    """The preflight: before any kernel runs, say when the build has no code for a GPU and
    when flash attention is off for it."""
    if backend.name != "rocm":
        return
    from torchbridge_amd.devices import preflight_for

    for index in range(backend.device_count):
        for warning in preflight_for(index).warnings:
            logger.warning("%s", warning)


@hookimpl
def torchbridge_kernel_implementations() -> list[KernelImplementation]:
    from torchbridge_amd.kernels import implementations

    return list(implementations())


@hookimpl
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "rocm":
        return None
    from torchbridge_amd.passes import amd_passes

    return amd_passes(backend)
