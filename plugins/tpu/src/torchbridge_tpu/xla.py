"""Device description, memory and synchronization on the XLA device."""

from __future__ import annotations

import logging
import re

import torch
from torchbridge.types import DeviceInfo, MemoryStats

from torchbridge_tpu import probe

logger = logging.getLogger(__name__)
_GB = 1024**3
# Device kinds the runtime reports -> TPUVersion values.
_VERSIONS = {"v5 lite": "v5e", "v5litepod": "v5e", "v6 lite": "v6e", "v5p": "v5p", "v5": "v5p"}


def tpu_version(device_kind: str | None) -> str | None:
    """"TPU v4" -> "v4", "TPU v5 lite" -> "v5e"; None when it is not a TPU kind we read."""
    if not device_kind or not device_kind.startswith("TPU"):
        return None
    rest = device_kind[3:].strip().lower()
    for prefix, version in _VERSIONS.items():
        if rest.startswith(prefix):
            return version
    match = re.match(r"v\d+[a-z]?", rest)
    return match.group(0) if match else None


def describe_device(device: torch.device, backend_name: str) -> DeviceInfo:
    runtime = probe.xla_runtime()
    index = device.index or 0
    attributes = runtime.device_attributes[index] if index < len(runtime.device_attributes) \
        else {}
    kind = str(attributes.get("device_kind", runtime.device_kind))
    version = tpu_version(kind)
    stats = memory_stats(device)
    on_tpu = runtime.device_kind == "TPU"
    return DeviceInfo(
        name=kind if on_tpu else f"XLA:{runtime.device_kind}",
        backend=backend_name,
        memory_total_gb=stats.total_bytes / _GB if stats.total_bytes else None,
        memory_available_gb=stats.free_bytes / _GB if stats.free_bytes is not None else None,
        compute_capability=version,
        supported_dtypes=["float32", "bfloat16", "float16"],
        vendor="Google",
        architecture=version if on_tpu else f"xla-{runtime.device_kind.lower()}",
        # bf16 is the TPU's native matmul dtype. On XLA:CPU the same policy is kept on
        # purpose: it is the stand-in for a TPU, so it must take the TPU's code paths.
        preferred_low_precision_dtype="bfloat16",
        device=str(device),
        extra={"device_kind": runtime.device_kind, "tpu_version": version,
               "device_count": runtime.device_count, "world_size": runtime.world_size,
               "attributes": attributes},
    )


def memory_stats(device: torch.device) -> MemoryStats:
    try:
        info = probe.memory_info(device)
    except RuntimeError as exc:  # XLA:CPU: "UNIMPLEMENTED: GetAllocatorStats is not supported"
        reason = str(exc).split("\n")[0]
        return MemoryStats(device=str(device), notes="this XLA runtime reports no memory "
                           f"figures ({reason}); they are unknown, not zero")
    if info is None:
        return MemoryStats(device=str(device), notes="this XLA runtime reports no memory")
    return MemoryStats(device=str(device), allocated_bytes=info["used"],
                       peak_allocated_bytes=info["peak"], free_bytes=info["limit"] - info["used"],
                       total_bytes=info["limit"],
                       notes="XLA has no caching allocator: reserved is unknown")


def sync(wait: bool = True) -> None:
    """Cut the lazy graph and run it (torch_xla.sync); with `wait`, block until the device
    has finished."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    if wait:
        xm.wait_device_ops()

