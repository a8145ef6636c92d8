"""The AMD plugin's kernel implementations: the core's FP8 linear for the `linear` op on
rocm, in the FP8 dtype of the architecture's matrix cores (fnuz on gfx942, OCP on gfx950
and RDNA4), on the architectures torch's `_scaled_mm` allows with the ROCm this torch was
built with (the table is architecture.FP8_MIN_ROCM). The core's Triton kernels serve rocm
through the built-in `triton` plugin."""

from __future__ import annotations

import functools

import torch
from torchbridge.kernels.fp8_linear import fp8_linear_implementation
from torchbridge.kernels.implementations import KernelImplementation

from torchbridge_amd import probe
from torchbridge_amd.architecture import FP8_MIN_ROCM, rocm_needed

_FP8_LINEARS = (("rocm_fp8_linear_e4m3fnuz", torch.float8_e4m3fnuz, ("gfx942",)),
                ("rocm_fp8_linear_e4m3", torch.float8_e4m3fn, ("gfx950", "gfx1200", "gfx1201")))


def implementations() -> list[KernelImplementation]:
    return list(_for_hip(probe.hip_version()))


@functools.cache
def _for_hip(hip_version: str | None) -> tuple[KernelImplementation, ...]:
    # Made once per HIP version, which is one per process: the same objects each call, so
    # each gets one wrapper op. Each serves the architectures torch's gate allows with this
    # ROCm; with none left it is unavailable, saying which ROCm it needs.
    made = []
    for name, dtype, archs in _FP8_LINEARS:
        needs = {a: rocm_needed(FP8_MIN_ROCM, a, hip_version) for a in archs}
        allowed = tuple(a for a in archs if not needs[a])
        unavailable = None if allowed else (
            "torch's _scaled_mm allows FP8 on "
            + ", ".join(f"{a} from {needs[a]}" for a in archs)
            + f"; this torch is built with HIP {hip_version}")
        made.append(fp8_linear_implementation(name, dtype, backends=("rocm",),
                                              architectures=allowed or archs,
                                              unavailable=unavailable))
    return tuple(made)
