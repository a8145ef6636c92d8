"""`config.hardware.intel`. Imported only when a config is loaded (pydantic is not cheap).

Nothing here touches the device: "auto" values are resolved against the device's reported
capabilities when a pass or the device description runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torchbridge.config import ConfigSection


class IntelConfig(ConfigSection):
    precision: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="compute dtype at O2+: auto follows the device (bf16 with "
        "XMX, else fp16); a dtype the device lacks falls back to auto with a note; float32 "
        "turns autocast off")
    allow_tf32: bool = Field(default=True, description="TF32 float32 matmuls and convolutions "
                             "at O2+ where torch reports TF32 support")
    use_ipex: bool | Literal["auto"] = Field(
        default="auto", description="ipex.optimize at O2+: auto when intel-extension-for-"
        "pytorch matching this torch is installed; True requires it (strict mode: an "
        "error, else a skipped pass)")
    enable_oom_protection: bool | None = Field(
        default=None, description="None: use memory.enable_oom_protection")
    max_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0, description="None: use memory.max_memory_fraction "
        "(applied with torch.xpu.set_per_process_memory_fraction)")
    oom_safety_margin: float | None = Field(
        default=None, ge=1.0, le=10.0, description="None: use memory.oom_safety_margin")
    pool_max_tensors: int = Field(default=64, ge=0, description="tensors per memory pool")
    pool_max_bytes: int | None = Field(default=None, ge=0,
                                       description="bytes per memory pool (None: no limit)")
