"""Failure class 12: a config section named "cpu", the built-in plugin's."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_config_section() -> tuple[str, Any]:
        from torchbridge import ConfigSection

        class HijackedCPUConfig(ConfigSection):
            num_threads: int = 1
            hijacked: bool = True

        return "cpu", HijackedCPUConfig
