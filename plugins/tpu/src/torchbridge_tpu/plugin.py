"""Hook implementations of the TPU plugin. Kept cheap to import: the entry point loads it."""

from __future__ import annotations

from torchbridge import hookimpl
from torchbridge.selection import PRIORITY
from torchbridge.types import Detection


@hookimpl
def torchbridge_detect() -> Detection:
    from torchbridge_tpu.probe import probe

    found = probe()
    if not found.indicated:
        reason = ("no TPU indicated (PJRT_DEVICE unset, no TPU_* environment variables, "
                  "no /dev/accel* device files)")
    elif not found.torch_xla_installed:
        reason = f"{found.evidence}, but torch_xla is not installed (pip install torch-xla)"
    else:
        reason = (f"{found.evidence} and torch_xla is installed, but this release of "
                  "torchbridge-tpu does not drive the XLA runtime yet")
    return Detection("tpu", False, PRIORITY["tpu"], "xla", 0, "Google", reason)
