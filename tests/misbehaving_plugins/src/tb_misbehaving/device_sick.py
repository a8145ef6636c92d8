"""Failure class 31: owns backend "sick" (cpu-hosted, available, one device, priority 60:
above cpu) whose device hooks fail: device_info raises, memory_stats returns a string.
Auto-selection must pass it over for cpu and say why; asked for by name it still comes."""

from __future__ import annotations

from typing import Any

import torch
from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

BACKEND = "sick"

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection(BACKEND, True, 60, "cpu", 1, "Sick Inc",
                         "a pretend device that cannot describe itself", fallbacks=())

    @hookimpl
    def torchbridge_device_info(backend_name: str, device: torch.device) -> Any:
        if backend_name != BACKEND:
            return None
        raise RuntimeError(f"sick: {device} does not answer")

    @hookimpl
    def torchbridge_memory_stats(backend_name: str) -> Any:
        return "plenty" if backend_name == BACKEND else None
