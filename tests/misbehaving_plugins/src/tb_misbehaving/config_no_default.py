"""Failure class 10: a config section with a field that has no default, so the section cannot
be built from its defaults."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

SECTION = "strictless"

if ACTIVE:

    @hookimpl
    def torchbridge_config_section() -> tuple[str, Any]:
        from torchbridge import ConfigSection

        class StrictlessConfig(ConfigSection):
            required_path: str  # no default: a config with defaults only cannot exist
            retries: int = 3

        return SECTION, StrictlessConfig
