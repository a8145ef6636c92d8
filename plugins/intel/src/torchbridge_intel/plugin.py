"""Hook implementations of the Intel plugin. Kept cheap to import: the entry point loads it."""

from __future__ import annotations

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection

# Memory, synchronize and the rest come from the core's generic answers for torch.cuda/xpu.
GENERIC = ("generic",)


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_intel.probe import probe

    found = probe()
    return Detection("xpu", found.available, PRIORITY["xpu"], "xpu", found.device_count,
                     "Intel", found.reason,
                     fallbacks=GENERIC)
