"""Failure class 15: the passes hook returns one OptimizationPass instead of a list (for
every backend)."""

from __future__ import annotations

from typing import Any

from torchbridge import OptimizationLevel, OptimizationPass, hookimpl

from tb_misbehaving import ACTIVE


def _identity(model: Any, ctx: Any) -> Any:
    return model


if ACTIVE:

    @hookimpl
    def torchbridge_optimization_passes() -> Any:
        return OptimizationPass("mb_lonely", "a single pass, not in a list",
                                OptimizationLevel.O0, _identity, mutates=False)
