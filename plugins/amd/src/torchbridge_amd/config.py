"""`config.hardware.amd`. Imported only when a config is loaded (pydantic is not cheap).

Values that depend on the GPU ("auto") are resolved against the device when a pass, the
device description or the memory manager runs, never at config load: loading a config does
not touch HIP.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator
from torchbridge.config import ConfigModel

from torchbridge_amd.architecture import ARCHITECTURES, arch_name


class AMDConfig(ConfigModel):
    architecture: str = Field(
        default="auto", description="auto: from the device's gcnArchName; a gfx name "
        f"({', '.join(ARCHITECTURES)}) only fills in for a GPU this plugin's table does not "
        "know")
    fp8_enabled: bool | Literal["auto"] = Field(
        default="auto", description="FP8 linears at O3; auto: where torch's _scaled_mm "
        "allows FP8 with this torch's ROCm: gfx942 (fnuz), gfx1200/1201 from ROCm 6.3 and "
        "gfx950 from ROCm 6.5 (OCP). True elsewhere is an error in strict mode, a skipped "
        "pass otherwise")
    preferred_blas: Literal["auto", "hipblaslt", "hipblas", "ck"] = Field(
        default="auto", description="torch.backends.cuda.preferred_blas_library at O1; auto: "
        "hipBLASLt where torch supports it on the architecture")
    flash_attention_library: Literal["auto", "aotriton", "ck"] = Field(
        default="auto", description="torch.backends.cuda.preferred_rocm_fa_library at O2; "
        "auto keeps torch's default (AOTriton); ck only on gfx90a/gfx942")
    allow_tf32: bool = Field(default=True, description="TF32 matmuls at O2+ where torch "
                             "reports TF32 support: XF32 matrix instructions on gfx94x, "
                             "hipBLASLt's bf16 emulation on gfx950")
    enable_oom_protection: bool | None = Field(
        default=None, description="None: use memory.enable_oom_protection")
    max_memory_fraction: float | None = Field(
        default=None, gt=0.0, le=1.0, description="None: use memory.max_memory_fraction")
    oom_safety_margin: float | None = Field(
        default=None, ge=1.0, description="None: use memory.oom_safety_margin")
    pool_max_tensors: int = Field(default=64, ge=0, description="tensors per memory pool")
    pool_max_bytes: int | None = Field(default=None, ge=0,
                                       description="bytes per memory pool (None: no limit)")

    @field_validator("architecture")
    @classmethod
    def _known_architecture(cls, value: str) -> str:
        if value == "auto":
            return value
        name = arch_name(value.lower())
        if name not in ARCHITECTURES:
            raise ValueError(f"{value!r} is not an architecture this plugin knows; expected "
                             f"auto or one of {', '.join(ARCHITECTURES)}")
        return name
