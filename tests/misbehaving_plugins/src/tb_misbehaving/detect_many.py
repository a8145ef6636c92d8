"""Failure class 32: a cpu-hosted backend "manycore" claiming 64 devices (more than this
host has CPUs, and than any host has of one backend; at least one more than os.cpu_count()
on a bigger host), priority 50: were it accepted, it would be the best backend."""

from __future__ import annotations

import os

from torchbridge import Detection, hookimpl

from tb_misbehaving import ACTIVE

DEVICES = max(64, (os.cpu_count() or 1) + 1)

if ACTIVE:

    @hookimpl
    def torchbridge_detect() -> Detection:
        return Detection("manycore", True, 50, "cpu", DEVICES, "Many Corp", fallbacks=("cpu",))
