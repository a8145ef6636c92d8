"""Hook implementations of the Intel plugin. Kept cheap to import: the entry point loads it,
and nothing here touches the XPU runtime until a hook about an xpu device is called.

The plugin answers every device-level hook itself (through the probe seam) and opts into no
core fallback: the generic fallback would name "xccl" as the distributed backend from torch's
table even in builds without XCCL.
"""

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
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

logger = logging.getLogger(__name__)


def _mine(backend_name: str, device: torch.device) -> bool:
    return backend_name == "xpu" and device.type == "xpu"


@hookimpl
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge_intel.config import IntelConfig

    return "intel", IntelConfig


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_intel.probe import probe

    found = probe()
    return Detection("xpu", found.available, PRIORITY["xpu"], "xpu", found.device_count,
                     "Intel", found.reason, fallbacks=())


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Backend
                            ) -> DeviceInfo | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel.devices import describe_device

    return describe_device(device.index or 0, backend_name, backend.hardware_config)


@hookimpl
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel import probe

    index = device.index or 0
    free_total = probe.mem_get_info(index)
    counters = probe.allocator_counters(index)
    if free_total is None:
        return MemoryStats.from_caching_allocator(
            device, counters, None, probe.device_properties(index).total_memory,
            "torch.xpu.mem_get_info is unavailable: free memory unknown, total from the "
            "device properties")
    free, total = free_total
    return MemoryStats.from_caching_allocator(
        device, counters, free, total, "free and total from torch.xpu.mem_get_info "
                                       "(all processes)")


@hookimpl
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel import probe

    probe.synchronize(device.index or 0)
    return True


@hookimpl
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel import probe

    probe.empty_cache()
    return True


@hookimpl
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device
                                        ) -> bool | None:
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel import probe

    probe.reset_peak_memory_stats(device.index or 0)
    return True


@hookimpl
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    """"xccl" when this torch has it; otherwise None, and the reason is logged and in
    DeviceInfo.extra["distributed_backend_reason"]."""
    if not _mine(backend_name, device):
        return None
    from torchbridge_intel import probe

    available, reason = probe.xccl_status()
    if not available:
        logger.info("no distributed backend for xpu: %s", reason)
        return None
    return "xccl"


@hookimpl
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "xpu":
        return None
    from torchbridge_intel.passes import intel_passes

    return intel_passes(backend)
