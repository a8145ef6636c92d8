"""The probe seam: the only module that asks the ROCm runtime what is present.

A ROCm build of torch exposes AMD GPUs through torch.cuda with torch.version.hip set. No
amdsmi import here: without its library `import amdsmi` raises KeyError, and discovery
must stay cheap.
"""

from __future__ import annotations

import torch
from torchbridge.types import ProbeResult


def probe() -> ProbeResult:
    if not getattr(torch.version, "hip", None):
        return ProbeResult(False, 0, f"torch {torch.__version__} is not a ROCm build "
                                     "(torch.version.hip is None); install a ROCm build of torch")
    if not torch.cuda.is_available():
        return ProbeResult(False, 0, "no AMD GPU visible to HIP (no amdgpu driver, or "
                                     "HIP_VISIBLE_DEVICES hides them)")
    return ProbeResult(True, torch.cuda.device_count(), None)
