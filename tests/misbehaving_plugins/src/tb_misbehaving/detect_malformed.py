"""Failure class 5: a list of malformed Detections, each wrong in exactly one way. None of
them may be offered as a backend; each is this plugin's error."""

from __future__ import annotations

from typing import Any

import torch
from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE


def fake_cuda_count() -> int:
    return torch.cuda.device_count() + 1


def malformed() -> list[Any]:
    """The Detections this plugin reports, in order (a plain function: no hook, no side
    effect, so the tests can inspect them while the gate is closed)."""
    return [
        Detection("mb_priority_str", False, "high", reason="priority is a string"),  # type: ignore[arg-type]
        Detection("mb_priority_none", False, None, reason="priority is None"),  # type: ignore[arg-type]
        Detection(None, False, 0, reason="no name"),  # type: ignore[arg-type]
        Detection("mb_available_str", "no", 0, reason="available is a string"),  # type: ignore[arg-type]
        Detection("mb_zero_devices", True, 0, "cpu", 0, fallbacks=()),
        Detection("mb_warpdrive", True, 0, "warpdrive", 1, fallbacks=()),
        # One cuda device more than torch sees: 1 on the CPU-only build the tests run on.
        # Priority 500: were it accepted, selection would pick it over cpu.
        Detection("mb_fake_cuda", True, 500, "cuda", fake_cuda_count(), fallbacks=("generic",)),
    ]


if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> list[Any]:
        return malformed()
