"""Failure class 16: the passes hook returns the int 7 (for every backend)."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_optimization_passes(level: Any) -> Any:
        return 7
