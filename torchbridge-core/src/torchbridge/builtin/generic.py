"""The "generic" fallback: the core's answers for any torch accelerator (cuda, rocm, xpu,
mps, ...), for backends whose Detection opts into it. Registered trylast.

Everything here goes through `torch.get_device_module(device.type)`, so a vendor plugin only
adds what is vendor-specific (architecture names, precision policy, its own passes). A
function a device module lacks gives None, never a made-up value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torchbridge.devices import device_module
from torchbridge.hookspecs import hookimpl
from torchbridge.types import DeviceInfo, MemoryStats

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.levels import OptimizationLevel
    from torchbridge.optimize.passes import OptimizationPass

_GB = 1024**3


def _call(module: Any, name: str, *args: Any) -> Any | None:
    func = getattr(module, name, None)
    if func is None:
        return None
    return func(*args)


@hookimpl(trylast=True)
def torchbridge_device_info(backend_name: str, device: torch.device) -> DeviceInfo | None:
    module = device_module(device)
    if module is None or not hasattr(module, "get_device_properties"):
        return None
    props = module.get_device_properties(device)
    free_total = _call(module, "mem_get_info", device)
    total = getattr(props, "total_memory", None)
    major, minor = getattr(props, "major", None), getattr(props, "minor", None)
    bf16 = bool(_call(module, "is_bf16_supported"))
    dtypes = ["float32", "float16"] + (["bfloat16"] if bf16 else [])
    return DeviceInfo(
        name=getattr(props, "name", device.type),
        backend=backend_name,
        memory_total_gb=total / _GB if total is not None else None,
        memory_available_gb=free_total[0] / _GB if free_total else None,
        compute_capability=f"{major}.{minor}" if major is not None else None,
        supported_dtypes=dtypes,
        preferred_low_precision_dtype="bfloat16" if bf16 else "float16",
        device=str(device),
        extra={"multiprocessor_count": getattr(props, "multi_processor_count", None)},
    )


@hookimpl(trylast=True)
def torchbridge_memory_stats(backend_name: str, device: torch.device) -> MemoryStats | None:
    module = device_module(device)
    if module is None:
        return None
    free_total = _call(module, "mem_get_info", device)
    return MemoryStats(
        device=str(device),
        allocated_bytes=_call(module, "memory_allocated", device),
        reserved_bytes=_call(module, "memory_reserved", device),
        peak_allocated_bytes=_call(module, "max_memory_allocated", device),
        free_bytes=free_total[0] if free_total else None,
        total_bytes=free_total[1] if free_total else None,
    )


def _run(device: torch.device, name: str, *args: Any) -> bool | None:
    module = device_module(device)
    if module is None or not hasattr(module, name):
        return None
    getattr(module, name)(*args)
    return True


@hookimpl(trylast=True)
def torchbridge_empty_cache(backend_name: str, device: torch.device) -> bool | None:
    return _run(device, "empty_cache")


@hookimpl(trylast=True)
def torchbridge_reset_peak_memory_stats(backend_name: str, device: torch.device) -> bool | None:
    return _run(device, "reset_peak_memory_stats", device)


@hookimpl(trylast=True)
def torchbridge_synchronize(backend_name: str, device: torch.device) -> bool | None:
    return _run(device, "synchronize", device)


@hookimpl(trylast=True)
def torchbridge_distributed_backend(backend_name: str, device: torch.device) -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return None
    # torch's own table: {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", ...}. It names a
    # backend whether or not this build has it (nccl on a build without NCCL, xccl without
    # oneCCL): only one that is built in is an answer.
    name = dist.Backend.default_device_backend_map.get(device.type)
    built = {"nccl": "is_nccl_available", "xccl": "is_xccl_available",
             "gloo": "is_gloo_available", "mpi": "is_mpi_available"}
    check = getattr(dist, built.get(name or "", ""), None)
    if check is not None and not check():
        return None
    return name


@hookimpl(trylast=True)
def torchbridge_optimization_passes(backend: Backend, level: OptimizationLevel
                                    ) -> list[OptimizationPass]:
    from torchbridge.optimize.core_passes import core_passes
    from torchbridge.optimize.kernel_substitution import kernel_substitution_pass
    from torchbridge.optimize.quantize import quantize_passes

    return [*core_passes(), kernel_substitution_pass(), *quantize_passes()]
