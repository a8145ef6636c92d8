"""The `linear` op in FP8, as an implementation the GPU vendor plugins register with their
architecture's FP8 dtype (float8_e4m3fn on NVIDIA Ada/Hopper and newer, AMD gfx950 and
RDNA4; float8_e4m3fnuz on AMD gfx94x). Activations and weights are quantized per call with
per-tensor scales and multiplied by torch._scaled_mm (`torchbridge.fp8`), output in the
input's dtype. Inference only; the correctness gate decides whether its error (a few
percent of the output's range) is acceptable for a model.
"""

from __future__ import annotations

from typing import Any

import torch

from torchbridge.fp8 import ALIGNMENT, quantize_fp8, scaled_mm
from torchbridge.kernels.implementations import KernelImplementation


def _declines(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    out_features, in_features = weight.shape
    if in_features % ALIGNMENT or out_features % ALIGNMENT:
        return f"FP8 GEMMs need dimensions divisible by {ALIGNMENT}, got {in_features} -> " \
               f"{out_features}"
    return None


def fp8_linear_implementation(name: str, fp8_dtype: torch.dtype, **declared: Any
                              ) -> KernelImplementation:
    """A KernelImplementation of `linear` computing in `fp8_dtype`; `declared` adds its
    backends, least capability or architectures."""

    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                ) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, x_scale = quantize_fp8(x.reshape(-1, x.shape[-1]), fp8_dtype)
        wq, w_scale = quantize_fp8(weight, fp8_dtype)
        out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        out = scaled_mm(xq, wq.t(), x_scale, w_scale,
                        None if bias is None else bias.to(out_dtype), out_dtype)
        return out.reshape(*lead, weight.shape[0]).to(x.dtype)

    return KernelImplementation(
        "linear", name, forward, dtypes=(torch.bfloat16, torch.float16), declines=_declines,
        description=f"dynamic per-tensor {str(fp8_dtype).removeprefix('torch.')} through "
                    "torch._scaled_mm", **declared)
