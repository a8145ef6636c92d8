"""The probe seam: the only module that asks the CUDA runtime what is present.

Tests replace `probe()` with recorded properties of real devices. Nothing here creates a
CUDA context: torch.cuda.is_available() and device_count() query the driver only.
"""

from __future__ import annotations

import torch
from torchbridge.types import ProbeResult


def probe() -> ProbeResult:
    if getattr(torch.version, "hip", None):
        return ProbeResult(False, 0, "this torch is a ROCm build: its GPUs are AMD's "
                                     "(torchbridge-amd), not NVIDIA's")
    if torch.version.cuda is None:
        return ProbeResult(False, 0, f"torch {torch.__version__} is built without CUDA; "
                                     "install a CUDA build of torch")
    if not torch.cuda.is_available():
        return ProbeResult(False, 0, "no NVIDIA GPU visible to CUDA (no driver, or "
                                     "CUDA_VISIBLE_DEVICES hides them)")
    return ProbeResult(True, torch.cuda.device_count(), None)
