"""Failure class 20: owns backend "badinfo" (cpu-hosted, available, one device, priority
-20, no core fallbacks) and answers its device-level hooks badly: device_info raises,
memory_stats returns a string."""

from __future__ import annotations

from typing import Any

import torch
from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

BACKEND = "badinfo"

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection(BACKEND, True, -20, "cpu", 1, "BadInfo Inc",
                         "a pretend device whose plugin cannot describe it", fallbacks=())

    @hookimpl
    def torchbridge_device_info(backend_name: str, device: torch.device) -> Any:
        if backend_name != BACKEND:
            return None
        raise RuntimeError(f"badinfo: cannot describe {device}, the driver is on fire")

    @hookimpl
    def torchbridge_memory_stats(backend_name: str) -> Any:
        return "lots" if backend_name == BACKEND else None
