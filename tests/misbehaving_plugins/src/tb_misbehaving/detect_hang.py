"""Failure class 30: a detect hook that hangs (a driver probe waiting on a dead device).
Were it waited for, it would report backend "mb_hang" available at priority 900 and be
selected; past the detection deadline it is unavailable and never waited for again."""

from __future__ import annotations

import threading

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

HANG_SECONDS = 3600.0
released = threading.Event()  # a test may set it to let the hung thread finish
calls = [0]  # how often the hook was entered: a rescan must not ask it again

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        calls[0] += 1
        released.wait(HANG_SECONDS)
        return Detection("mb_hang", True, 900, "cpu", 1, "Hang Corp", fallbacks=("cpu",))
