"""Failure class 7: calls `torchbridge.list_backends()` from its own detect hook."""

from __future__ import annotations

from typing import Any

import torchbridge
from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Any:
        torchbridge.list_backends()
        return torchbridge.Detection("mb_reentrant", False, 0, reason="never reached",
                                     fallbacks=())
