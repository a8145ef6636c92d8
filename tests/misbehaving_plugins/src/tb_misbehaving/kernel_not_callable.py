"""Failure class 22: a tryfirst kernel hook answering 42 (not callable) for every op,
"rms_norm" included, on every backend."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

ANSWER = 42

if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_kernel(op: str) -> Any:
        return ANSWER
