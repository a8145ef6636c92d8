"""Failure class 13: loads the whole config from inside its own section hook."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

SECTION = "reentrant_section"

if ACTIVE:

    @hookimpl
    def torchbridge_config_section() -> tuple[str, Any]:
        from torchbridge import ConfigSection, TorchBridgeConfig

        TorchBridgeConfig.load()  # re-enters the step that is calling this hook

        class ReentrantConfig(ConfigSection):
            value: int = 0

        return SECTION, ReentrantConfig
