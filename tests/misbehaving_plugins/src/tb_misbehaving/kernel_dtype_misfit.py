"""Failure class: a kernel that returns the wrong dtype. Its rms_norm computes in float32,
right, and forgets to cast back: bfloat16 in, float32 out, where the reference (and the
op's fake, which torch.compile believes) returns bfloat16. Checked in float32 only, it
passes; under O3's bf16 autocast the graph's dtypes are wrong at the first compiled call.

Reads the gate at its own import (not tb_misbehaving.ACTIVE), so that a test can load it
active on its own, from its file, without importing the package; register it with
torchbridge.register_plugin(module, name=...).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torchbridge import KernelImplementation, hookimpl

# tb_misbehaving.GATE, read here: importing the package with the gate open would leave
# it (and every module of it imported later) active for the whole process.
GATE = "TB_MISBEHAVING_PLUGINS"
ACTIVE = os.environ.get(GATE) == "1"
NAME = "float32_out_rms_norm"


def float32_out_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                         ) -> torch.Tensor:
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return out * weight.float() if weight is not None else out  # no .to(x.dtype)


if ACTIVE:

    @hookimpl(tryfirst=True)
    def torchbridge_kernel_implementations(backend: Any) -> list[KernelImplementation]:
        return [KernelImplementation("rms_norm", NAME, float32_out_rms_norm, priority=100,
                                     backends=("cpu",), description="returns float32")]
