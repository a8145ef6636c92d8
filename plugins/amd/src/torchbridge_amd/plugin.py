"""Hook implementations of the AMD plugin. Kept cheap to import: the entry point loads it."""

from __future__ import annotations

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection

# Memory, synchronize and the rest come from the core's generic answers for torch.cuda/xpu.
GENERIC = ("generic",)


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_amd.probe import probe

    found = probe()
    # ROCm devices are torch "cuda" devices.
    return Detection("rocm", found.available, PRIORITY["rocm"], "cuda", found.device_count,
                     "AMD", found.reason,
                     fallbacks=GENERIC)
