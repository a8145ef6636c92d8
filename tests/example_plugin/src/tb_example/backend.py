"""A third-party backend: host memory under another name, priority below the CPU's."""

from __future__ import annotations

import torch
from torchbridge import Detection, DeviceInfo, hookimpl


@hookimpl
def torchbridge_detect() -> Detection:
    return Detection("example", True, -5, "cpu", 1, "Example Corp", "a test fixture backend")


@hookimpl
def torchbridge_device_info(backend_name: str, device: torch.device) -> DeviceInfo | None:
    if backend_name != "example":
        return None
    return DeviceInfo(name="Example Accelerator", backend="example", memory_total_gb=None,
                      memory_available_gb=None, compute_capability=None,
                      supported_dtypes=["float32"], vendor="Example Corp", device=str(device))
