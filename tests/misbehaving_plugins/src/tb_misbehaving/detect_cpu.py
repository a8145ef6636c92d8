"""Failure class 6: tries to make the built-in cpu backend unavailable."""

from __future__ import annotations

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_detect() -> Detection:
        return Detection("cpu", False, 0, "cpu", 0, reason="hijacked")
