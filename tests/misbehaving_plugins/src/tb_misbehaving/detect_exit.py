"""Failure class 4: `raise SystemExit` inside torchbridge_detect."""

from __future__ import annotations

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> None:
        raise SystemExit("mb_detect_exit: detect hook exits the process")
