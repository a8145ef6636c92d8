"""`config.hardware.nvidia`. Imported only when a config is loaded (pydantic is not cheap).

Values that depend on the GPU ("auto") are resolved against the device when a pass or the
memory manager runs, never at config load: loading a config does not touch CUDA.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from torchbridge.config import ConfigModel

from torchbridge_nvidia.architecture import NVIDIAArchitecture


class NVIDIAConfig(ConfigModel):
    architecture: NVIDIAArchitecture | Literal["auto"] = Field(
        default="auto", description="auto: from the device's compute capability; set it "
        "only for a GPU newer than this plugin's table, whose DeviceInfo (dtypes, so "
        "autocast), passes and kernel choice then follow it; ignored for a GPU in the table")
    fp8_enabled: bool | Literal["auto"] = Field(
        default="auto", description="FP8 linears at O3; auto: on Ada (compute capability "
        "8.9) and newer. True on an older GPU is an error in strict mode, a skipped pass "
        "otherwise")
    cudnn_benchmark: bool = Field(default=True, description="let cuDNN pick the fastest "
                                  "convolution algorithm (helps when input shapes are fixed)")
    allow_tf32: bool = Field(default=True, description="TF32 matmuls and convolutions at O2+ "
                             "on Ampere and newer")
    flash_attention_version: Literal["auto", "3", "2", "sdpa"] = Field(
        default="auto", description="FlashAttention3 module: auto picks flash-attn 3 on "
        "Hopper, then flash-attn 2 on Ampere (8.0) and newer, then torch SDPA")
    enable_oom_protection: bool | None = Field(
        default=None, description="None: use memory.enable_oom_protection")
    max_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0, description="None: use memory.max_memory_fraction")
    pool_max_tensors: int = Field(default=64, ge=0, description="tensors per memory pool")
    pool_max_bytes: int | None = Field(default=None, ge=0,
                                       description="bytes per memory pool (None: no limit)")
