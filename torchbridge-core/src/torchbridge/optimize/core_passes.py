"""Passes the core offers on every backend."""

from __future__ import annotations

from torch import nn

from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass, PassContext


def _place(model: nn.Module, ctx: PassContext) -> nn.Module:
    return model.to(ctx.backend.device)


def core_passes() -> list[OptimizationPass]:
    return [
        OptimizationPass("device_placement", "moved parameters and buffers to the device",
                         OptimizationLevel.O0, _place, order=0),
    ]
