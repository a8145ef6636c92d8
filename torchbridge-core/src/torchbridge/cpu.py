"""The built-in CPU backend: always available, registered trylast so plugins can override it."""

from __future__ import annotations

import functools
import os
import platform
from typing import TYPE_CHECKING, Any

import torch

from torchbridge.hookspecs import hookimpl
from torchbridge.types import Detection, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    from pydantic import BaseModel

    from torchbridge.backend import Backend
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

_GB = 1024**3


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (lower case), from torch when it can tell, else /proc/cpuinfo."""
    get_capabilities = getattr(torch.cpu, "get_capabilities", None)  # torch >= 2.8
    if get_capabilities is not None:
        return frozenset(k for k, v in get_capabilities().items() if v is True)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX-BF16). Without it bf16 is emulated
    and slower than float32, so autocast to bf16 would be a pessimization."""
    flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags)


_VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "HygonGenuine": "Hygon"}


@functools.lru_cache(maxsize=1)
def _cpuinfo_field(key: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "CPU"


def cpu_vendor() -> str | None:
    vendor_id = _cpuinfo_field("vendor_id")
    if vendor_id is not None:
        return _VENDORS.get(vendor_id, vendor_id)
    return _cpuinfo_field("CPU implementer")  # ARM: implementer code


def host_memory() -> tuple[int | None, int | None]:
    """(available, total) host memory in bytes; None where the OS will not say."""
    try:
        values = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, rest = line.split(":", 1)
                values[key] = int(rest.split()[0]) * 1024
        return values.get("MemAvailable"), values.get("MemTotal")
    except (OSError, ValueError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (ValueError, OSError, AttributeError):
        return None, None


@hookimpl(trylast=True)
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge.config import CPUConfig

    return "cpu", CPUConfig


@hookimpl(trylast=True)
def torchbridge_detect() -> Detection:
    return Detection(name="cpu", available=True, priority=0, device_type="cpu",
                     device_count=1, vendor=cpu_vendor())


def _mine(device: torch.device) -> bool:
    return device.type == "cpu"


@hookimpl(trylast=True)
def torchbridge_device_info(backend_name: str, device: torch.device) -> DeviceInfo | None:
    if not _mine(device):
        return None
    available, total = host_memory()
    bf16 = has_native_bf16()
    return DeviceInfo(
        name=cpu_name(),
        backend=backend_name,
        memory_total_gb=total / _GB if total is not None else None,
        memory_available_gb=available / _GB if available is not None else None,
        compute_capability=torch.backends.cpu.get_cpu_capability(),
        supported_dtypes=["float32", "float64", "bfloat16", "float16"],
        vendor=cpu_vendor(),
        architecture=platform.machine() or None,
        preferred_low_precision_dtype="bfloat16" if bf16 else None,
        device=str(device),
        extra={"threads": torch.get_num_threads(), "native_bf16": bf16,
               "native_fp16": bool({"avx512_fp16", "amx_fp16"} & cpu_flags())},
    )


@hookimpl(trylast=True)
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(device):
        return None
    available, total = host_memory()
    return MemoryStats(
        device=str(device), free_bytes=available, total_bytes=total,
        notes="the CPU allocator keeps no allocated/reserved/peak counters; "
              "free and total are the host's available and total memory")


@hookimpl(trylast=True)
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    # The CPU allocator returns memory to the OS on free: there is no cache to empty.
    return True if _mine(device) else None


@hookimpl(trylast=True)
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device) -> bool | None:
    # No peak counter exists on CPU (peak_allocated_bytes is None), so nothing to reset.
    return True if _mine(device) else None


@hookimpl(trylast=True)
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    # CPU kernels run synchronously on the calling thread.
    return True if _mine(device) else None


@hookimpl(trylast=True)
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "cpu":
        return None
    from torchbridge.optimize.cpu_passes import cpu_passes

    return cpu_passes(backend)


def apply_thread_setting(config: Any) -> None:
    threads = config.hardware.cpu.num_threads if hasattr(config.hardware, "cpu") else None
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
