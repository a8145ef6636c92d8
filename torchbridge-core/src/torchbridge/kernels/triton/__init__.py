"""Triton kernels for the core's ops, written so that Triton's interpreter checks them on CPU
(TRITON_INTERPRET=1, set before this package is imported): float32 arithmetic after each
load, `tl.*` math only (no libdevice), no `.to()` on scalar arguments.

Each op has a forward, a backward (or None), and a problem function that says why the kernel
declines a call (dtype, device, shapes it does not broadcast, rows too wide for one block),
so the caller can run the reference instead; calling a function with a declined call raises
KernelError with the same reason. Inputs may be float32, float16 or bfloat16 and
non-contiguous; outputs are contiguous, in the input's dtype.

`TRITON_KERNELS` is the registry: per op name, those functions, the jit kernels, and the
ahead-of-time compiles (`tests/kernels/aot_compile.py` builds each for sm_80, sm_90 and an
AMD target without a GPU).

Importing this package needs triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchbridge.kernels.triton import rms_norm, rotary, silu_mul
from torchbridge.kernels.triton._launch import AotSpec
from torchbridge.kernels.triton.rms_norm import (
    add_rms_norm_backward,
    add_rms_norm_forward,
    add_rms_norm_problem,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_problem,
)
from torchbridge.kernels.triton.rotary import rotary_backward, rotary_forward, rotary_problem
from torchbridge.kernels.triton.silu_mul import (
    silu_mul_backward,
    silu_mul_forward,
    silu_mul_problem,
)


@dataclass(frozen=True)
class TritonOp:
    """One op's Triton implementation. `problem` takes the forward's arguments; `kernels` are
    the jit kernels it launches; `aot_specs()` the compiles the ahead-of-time check builds."""

    forward: Callable[..., Any]
    backward: Callable[..., Any] | None
    problem: Callable[..., str | None]
    kernels: tuple[Any, ...]
    aot_specs: Callable[[], list[AotSpec]]


TRITON_KERNELS: dict[str, TritonOp] = {
    "rms_norm": TritonOp(
        rms_norm_forward, rms_norm_backward, rms_norm_problem,
        (rms_norm.rms_norm_forward_kernel, rms_norm.rms_norm_backward_kernel),
        rms_norm.rms_norm_aot_specs),
    "silu_mul": TritonOp(
        silu_mul_forward, silu_mul_backward, silu_mul_problem,
        (silu_mul.silu_mul_forward_kernel, silu_mul.silu_mul_backward_kernel),
        silu_mul.aot_specs),
    "rotary_embedding": TritonOp(
        rotary_forward, rotary_backward, rotary_problem, (rotary.rotary_kernel,),
        rotary.aot_specs),
    # The backward shares rms_norm's kernel (rstd recomputed from the sum, grad_sum added).
    "add_rms_norm": TritonOp(
        add_rms_norm_forward, add_rms_norm_backward, add_rms_norm_problem,
        (rms_norm.add_rms_norm_forward_kernel, rms_norm.rms_norm_backward_kernel),
        rms_norm.add_rms_norm_aot_specs),
}

__all__ = [
    "TRITON_KERNELS",
    "AotSpec",
    "TritonOp",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "add_rms_norm_problem",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_problem",
    "rotary_backward",
    "rotary_forward",
    "rotary_problem",
    "silu_mul_backward",
    "silu_mul_forward",
    "silu_mul_problem",
]
