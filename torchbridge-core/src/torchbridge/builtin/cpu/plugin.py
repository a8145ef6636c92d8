"""The built-in CPU backend: always available. Its hooks answer for the cpu backend, and, as
the "cpu" fallback, for cpu-hosted backends that opted into it. Registered trylast, so a
third-party override runs first."""

from __future__ import annotations

import platform
from typing import TYPE_CHECKING

import torch

from torchbridge.builtin.cpu import host
from torchbridge.hookspecs import hookimpl
from torchbridge.types import Detection, DeviceInfo, MemoryStats

if TYPE_CHECKING:
    from pydantic import BaseModel

    from torchbridge.backend import Backend
    from torchbridge.kernels.implementations import KernelImplementation
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

_GB = 1024**3


@hookimpl(trylast=True)
def torchbridge_config_section() -> tuple[str, type[BaseModel]]:
    from torchbridge.builtin.cpu.config import CPUConfig

    return "cpu", CPUConfig


@hookimpl(trylast=True)
def torchbridge_detect() -> Detection:
    return Detection(name="cpu", available=True, priority=0, device_type="cpu",
                     device_count=1, vendor=host.cpu_vendor(), fallbacks=())


def _mine(device: torch.device) -> bool:
    return device.type == "cpu"


@hookimpl(trylast=True)
def torchbridge_device_info(backend_name: str, device: torch.device) -> DeviceInfo | None:
    if not _mine(device):
        return None
    available, total = host.host_memory()
    flags = host.cpu_flags()
    unit = host.bf16_unit()
    features = host.matrix_features()
    return DeviceInfo(
        name=host.cpu_name(),
        backend=backend_name,
        memory_total_gb=total / _GB if total is not None else None,
        memory_available_gb=available / _GB if available is not None else None,
        compute_capability=torch.backends.cpu.get_cpu_capability(),
        supported_dtypes=["float32", "float64", "bfloat16", "float16"],
        vendor=host.cpu_vendor(),
        architecture=platform.machine() or None,
        # The policy: bf16 autocast only where hardware computes bf16 (AMX-BF16 tiles or
        # AVX512-BF16); emulated bf16 is slower than float32.
        preferred_low_precision_dtype="bfloat16" if unit else None,
        device=str(device),
        extra={"threads": torch.get_num_threads(), "native_bf16": unit is not None,
               "bf16_unit": unit,
               "native_fp16": bool({"avx512_fp16", "amx_fp16"} & flags),
               "native_int8": bool({"amx_int8", "avx512_vnni", "avx_vnni"} & flags),
               "amx": features["amx"], "avx512": features["avx512"]},
        notes=None if unit else "no AMX-BF16 or AVX512-BF16: bf16 would be emulated, "
                                "so O2+ stays in float32",
    )


@hookimpl(trylast=True)
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    if not _mine(device):
        return None
    available, total = host.host_memory()
    return MemoryStats(
        device=str(device), free_bytes=available, total_bytes=total,
        notes="the CPU allocator keeps no allocated/reserved/peak counters; "
              "free and total are the host's available and total memory")


@hookimpl(trylast=True)
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    # torch's CPU allocator is malloc: what glibc keeps free in its heap (more of it once
    # the heap_reuse pass ran) goes back to the OS.
    if not _mine(device):
        return None
    from torchbridge.builtin.cpu import heap

    heap.trim()
    return True


@hookimpl(trylast=True)
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device) -> bool | None:
    # No peak counter exists on CPU (peak_allocated_bytes is None), so nothing to reset.
    return True if _mine(device) else None


@hookimpl(trylast=True)
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    # CPU kernels run synchronously on the calling thread.
    return True if _mine(device) else None


@hookimpl(trylast=True)
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    import torch.distributed as dist

    return "gloo" if _mine(device) and dist.is_available() else None


@hookimpl(trylast=True)
def torchbridge_backend_created(backend: Backend) -> None:
    threads = getattr(getattr(backend.config.hardware, "cpu", None), "num_threads", None)
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@hookimpl(trylast=True)
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass] | None:
    if backend.name != "cpu":
        return None
    from torchbridge.builtin.cpu.passes import cpu_passes

    return cpu_passes(backend)


@hookimpl(trylast=True)
def torchbridge_kernel_implementations(backend: Backend) -> list[KernelImplementation]:
    from torchbridge.builtin.cpu.attention import BF16_MATMUL_ATTENTION

    cpu_config = getattr(backend.config.hardware, "cpu", None)  # a dynamic section
    if cpu_config is None or not getattr(cpu_config, "bf16_matmul_attention", False):
        return []
    return [BF16_MATMUL_ATTENTION]
