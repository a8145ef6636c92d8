"""Failure class 24 (one half): entry point "twin", a name that
torchbridge-misbehaving-twin also uses. A valid plugin otherwise."""

from __future__ import annotations

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection("twin_one", False, 0, reason="twin_one: the first twin has no device",
                         fallbacks=())
