"""Failure class 23: a hook implementation whose name matches no hookspec (a typo), and a
`torchbridge_*` function without @hookimpl. Neither is ever called."""

from __future__ import annotations

from typing import Any

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_detct() -> Detection:  # sic: torchbridge_detect
        return Detection("mb_typo", True, 1000, "cpu", 1, fallbacks=())

    def torchbridge_synchronize(backend_name: str) -> Any:  # sic: no @hookimpl
        return True
