"""Failure class 11: a config section whose validator always raises (and not even a
ValueError, so pydantic does not wrap it)."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

SECTION = "grumpy"

if ACTIVE:

    @hookimpl
    def torchbridge_config_section() -> tuple[str, Any]:
        from pydantic import model_validator
        from torchbridge import ConfigSection

        class GrumpyConfig(ConfigSection):
            mood: str = "bad"

            @model_validator(mode="after")
            def _never_valid(self) -> GrumpyConfig:
                raise RuntimeError("grumpy: no value is ever good enough")

        return SECTION, GrumpyConfig
