"""Failure class 19: the passes hook raises SystemExit (for every backend)."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_optimization_passes(backend: Any) -> Any:
        raise SystemExit(f"mb_passes_exit: no passes for {backend.name}, exiting instead")
