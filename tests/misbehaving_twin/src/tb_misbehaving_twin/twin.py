"""Entry point "twin" of torchbridge-misbehaving-twin. A valid plugin; only its name clashes."""

from __future__ import annotations

from torchbridge import Detection, hookimpl

from tb_misbehaving_twin import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection("twin_two", False, 0, reason="twin_two: the second twin has no device",
                         fallbacks=())
