"""Failure class 34: declares TORCHBRIDGE_CONTRACT ">=1,<3", a plugin contract range this
core (3.x) is outside of. Were it run, its backend "contract_old" (priority 800) would be
selected; it must be reported "incompatible" and never called."""

from __future__ import annotations

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:
    TORCHBRIDGE_CONTRACT = ">=1,<3"

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection("contract_old", True, 800, "cpu", 1, "Old Corp", fallbacks=("cpu",))
