"""Failure class 8: a slow detect hook (0.6 s) that then reports a valid, unavailable
backend with a reason. Not an error: doctor shows it as slow discovery."""

from __future__ import annotations

import time

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

SLEEP_SECONDS = 0.6

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        time.sleep(SLEEP_SECONDS)
        return Detection("slowpoke", False, 1, "cpu", 0, "Slow Corp",
                         reason="slowpoke: the pretend driver took its time and found nothing",
                         fallbacks=())
