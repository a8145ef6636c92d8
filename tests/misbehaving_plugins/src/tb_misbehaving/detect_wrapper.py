"""Failure class 9: a detect hook declared as a (new-style) wrapper, which this hook does
not support."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl(wrapper=True)
    def torchbridge_detect() -> Generator[None, Any, Any]:
        result = yield
        return result
