"""A third-party backend: a pretend NPU with two devices, reached as the host CPU, priority
below the CPU's. It answers every device-level hook itself (fallbacks=()) and reads its own
config section through the `backend` argument."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torchbridge import Detection, DeviceInfo, MemoryStats, hookimpl

if TYPE_CHECKING:
    from pydantic import BaseModel

DEVICE_COUNT = 2


def _mine(backend_name: str) -> bool:
    return backend_name == "example"


@hookimpl
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from tb_example.config import ExampleConfig

    return "example", ExampleConfig


def probe() -> int:
    """The probe seam: how many pretend devices are present (tests patch it to 0)."""
    return DEVICE_COUNT


@hookimpl
def torchbridge_detect() -> Detection:
    count = probe()
    if not count:
        return Detection("example", False, -5, "cpu", 0, "Example Corp",
                         "no Example NPU found (the probe counted none)", fallbacks=())
    return Detection("example", True, -5, "cpu", count, "Example Corp",
                     "a test fixture backend", fallbacks=())


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device, backend: Any
                            ) -> DeviceInfo | None:
    if not _mine(backend_name):
        return None
    section = backend.hardware_config
    return DeviceInfo(name=f"Example Accelerator #{device.index}", backend="example",
                      memory_total_gb=section.memory_gb, memory_available_gb=section.memory_gb,
                      compute_capability=None, supported_dtypes=["float32"],
                      vendor="Example Corp", device=str(device),
                      extra={"greeting": section.greeting})


@hookimpl
def torchbridge_memory_stats(backend_name: str, device: torch.device, backend: Any
                             ) -> MemoryStats | None:
    if not _mine(backend_name):
        return None
    total = int(backend.hardware_config.memory_gb * 1024**3)
    return MemoryStats(device=str(device), free_bytes=total, total_bytes=total,
                       notes="the pretend device keeps no allocation counters")


@hookimpl
def torchbridge_synchronize(backend_name: str) -> bool | None:
    return True if _mine(backend_name) else None


@hookimpl
def torchbridge_empty_cache(backend_name: str) -> bool | None:
    return True if _mine(backend_name) else None


@hookimpl
def torchbridge_reset_peak_memory_stats(backend_name: str) -> bool | None:
    return True if _mine(backend_name) else None


@hookimpl
def torchbridge_distributed_backend(backend_name: str) -> str | None:
    return "gloo" if _mine(backend_name) else None
