"""Failure class 21: a tryfirst device_info override for every backend that answers with
the wrong type (a dict, not a DeviceInfo)."""

from __future__ import annotations

from typing import Any

import torch
from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_device_info(backend_name: str, device: torch.device) -> Any:
        return {"name": "Totally Real Accelerator", "backend": backend_name,
                "device": str(device)}
