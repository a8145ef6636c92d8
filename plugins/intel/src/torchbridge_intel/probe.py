"""The probe seam: the only module that asks the XPU runtime what is present.

torch >= 2.4 has torch.xpu built in; intel-extension-for-pytorch is not needed to detect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class XpuProbe:
    available: bool
    device_count: int
    reason: str | None


def probe() -> XpuProbe:
    xpu = getattr(torch, "xpu", None)
    if xpu is None:
        return XpuProbe(False, 0, f"torch {torch.__version__} has no torch.xpu")
    if not getattr(torch._C, "_has_xpu", True):
        return XpuProbe(False, 0, f"torch {torch.__version__} is built without XPU support; "
                                  "install an XPU build of torch")
    if not xpu.is_available():
        return XpuProbe(False, 0, "no Intel GPU visible to torch.xpu (no Level Zero driver, "
                                  "or ZE_AFFINITY_MASK hides them)")
    return XpuProbe(True, xpu.device_count(), None)
