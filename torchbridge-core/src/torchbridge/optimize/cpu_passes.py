"""Passes for the CPU backend."""

from __future__ import annotations

from torchbridge.optimize.passes import OptimizationPass


def cpu_passes() -> list[OptimizationPass]:
    return []
