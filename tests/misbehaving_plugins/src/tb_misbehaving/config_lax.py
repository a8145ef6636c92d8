"""Failure class 14: a section on plain pydantic.BaseModel (no extra="forbid", no assignment
validation). The core must still reject unknown keys and bad assignments, naming
`hardware.lax.<field>`. Valid once the core tightens it: this plugin ends up without error."""

from __future__ import annotations

from typing import Any

from torchbridge import hookimpl

from tb_misbehaving import ACTIVE

SECTION = "lax"

if ACTIVE:

    @hookimpl
    def torchbridge_config_section() -> tuple[str, Any]:
        from pydantic import BaseModel

        class LaxConfig(BaseModel):
            batch_hint: int = 8
            label: str = "lax"

        return SECTION, LaxConfig
