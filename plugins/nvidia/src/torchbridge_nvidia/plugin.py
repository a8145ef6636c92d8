"""Hook implementations of the NVIDIA plugin. Kept cheap to import: the entry point loads it."""

from __future__ import annotations

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_nvidia.probe import probe

    found = probe()
    return Detection("cuda", found.available, PRIORITY["cuda"], "cuda", found.device_count,
                     "NVIDIA", found.reason)
