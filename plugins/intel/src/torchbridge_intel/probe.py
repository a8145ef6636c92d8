"""The probe seam: the only module that asks the XPU runtime what is present.

torch >= 2.4 has torch.xpu built in; intel-extension-for-pytorch is not needed to detect.
"""

from __future__ import annotations

import torch
from torchbridge.types import ProbeResult


def probe() -> ProbeResult:
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return ProbeResult(False, 0, f"torch {torch.__version__} has no torch.xpu")
    if not getattr(torch._C, "_has_xpu", True):
        return ProbeResult(False, 0, f"torch {torch.__version__} is built without XPU support; "
                                     "install an XPU build of torch")
    if not xpu.is_available():
        return ProbeResult(False, 0, "no Intel GPU visible to torch.xpu (no Level Zero driver, "
                                     "or ZE_AFFINITY_MASK hides them)")
    return ProbeResult(True, xpu.device_count(), None)
