"""`config.hardware.cpu`: the built-in CPU backend's section."""

from __future__ import annotations

from pydantic import Field

from torchbridge.config import ConfigSection

MAX_THREADS = 4096


class CPUConfig(ConfigSection):
    """`config.hardware.cpu`, the built-in CPU backend's section."""

    # torch.set_num_threads takes a C int and OpenMP starts that many threads: far past
    # any machine's core count it fails or thrashes, so the bound is a generous ceiling.
    num_threads: int | None = Field(default=None, ge=1, le=MAX_THREADS,
                                    description="torch intra-op threads (None: torch's "
                                    f"default; at most {MAX_THREADS})")
    allow_bf16: bool = Field(default=True,
                             description="use bf16 autocast at O2+ when the CPU has native bf16")
