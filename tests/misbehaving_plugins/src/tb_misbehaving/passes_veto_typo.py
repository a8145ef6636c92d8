"""Failure class 18: vetoes a misspelled pass name ("compiel" for "compile"), for every
backend. The veto names no pass: reported, not an error."""

from __future__ import annotations

from typing import Any

from torchbridge import OptimizationPass, hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_optimization_passes() -> list[Any]:
        return [OptimizationPass.veto("compiel", "mb_passes_veto_typo: compile is too slow")]
