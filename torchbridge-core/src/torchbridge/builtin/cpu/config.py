"""`config.hardware.cpu`: the built-in CPU backend's section."""

from __future__ import annotations

from pydantic import Field

from torchbridge.config import ConfigSection


class CPUConfig(ConfigSection):
    """`config.hardware.cpu`, the built-in CPU backend's section."""

    num_threads: int | None = Field(default=None, ge=1,
                                    description="torch intra-op threads (None: torch's default)")
    allow_bf16: bool = Field(default=True,
                             description="use bf16 autocast at O2+ when the CPU has native bf16")
