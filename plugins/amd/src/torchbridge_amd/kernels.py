"""The AMD plugin's kernel implementations: the core's FP8 linear for the `linear` op on
rocm, in the FP8 dtype of the architecture's matrix cores (fnuz on gfx94x, OCP on gfx950
and RDNA4; the table is architecture.fp8_dtypes). The core's Triton kernels serve rocm
through the built-in `triton` plugin."""

from __future__ import annotations

import functools

import torch
from torchbridge.kernels.fp8_linear import fp8_linear_implementation
from torchbridge.kernels.implementations import KernelImplementation


@functools.cache
def implementations() -> list[KernelImplementation]:
    # Made once: the same objects each call, so each gets one wrapper op.
    return [
        fp8_linear_implementation("rocm_fp8_linear_e4m3fnuz", torch.float8_e4m3fnuz,
                                  backends=("rocm",),
                                  architectures=("gfx940", "gfx941", "gfx942")),
        fp8_linear_implementation("rocm_fp8_linear_e4m3", torch.float8_e4m3fn,
                                  backends=("rocm",),
                                  architectures=("gfx950", "gfx1200", "gfx1201")),
    ]
