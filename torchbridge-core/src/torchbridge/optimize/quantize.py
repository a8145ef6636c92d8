"""Quantization through torchao (placeholder: filled in by the quantization work)."""

from __future__ import annotations

from torchbridge.optimize.passes import OptimizationPass


def quantize_passes() -> list[OptimizationPass]:
    return []
