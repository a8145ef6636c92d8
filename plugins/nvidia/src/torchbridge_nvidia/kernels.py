"""The NVIDIA plugin's kernel implementations: flash-attn 3 (Hopper) and flash-attn 2
(Ampere and later) for the core's `scaled_dot_product_attention` op on cuda, and the
core's FP8 linear (e4m3fn) for the `linear` op from compute capability 8.9. The attention
op takes (batch, heads, seq, head_dim) like torch's SDPA; flash-attn takes (batch, seq,
heads, head_dim), so the layout is transposed around the call.

flash-attn 3 declares the architecture it is built for (Hopper), so selection passes it
over elsewhere and flash-attn 2 is chosen where it can run. Each declines what flash-attn
cannot do (a mask, float32, head sizes it has no kernel for), and the reference (torch's
SDPA) runs that call instead.
Inference only: the op's backward is the reference's.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch
from torchbridge.kernels.fp8_linear import fp8_linear_implementation
from torchbridge.kernels.implementations import KernelImplementation

from torchbridge_nvidia.architecture import (
    FLASH_ATTN_2_MIN_CAPABILITY,
    FLASH_ATTN_3_ARCHITECTURES,
    FLASH_ATTN_3_MIN_CAPABILITY,
    FP8_ARCHITECTURES,
    FP8_MIN_CAPABILITY,
)

HALF = (torch.float16, torch.bfloat16)


def _declines(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
              is_causal: bool, scale: Any, enable_gqa: bool) -> str | None:
    if attn_mask is not None:
        return "a mask is given and flash-attn takes none"
    head_dim = q.shape[-1]
    if head_dim > 256 or head_dim % 8:
        return f"head_dim {head_dim} is not a multiple of 8 up to 256"
    if q.shape[1] != k.shape[1] and not enable_gqa:
        return f"{q.shape[1]} query heads and {k.shape[1]} key heads without enable_gqa"
    if q.shape[1] % k.shape[1]:
        return f"{q.shape[1]} query heads do not group over {k.shape[1]} key heads"
    if is_causal and q.shape[-2] != k.shape[-2]:
        # flash-attn aligns a causal mask to the bottom right, torch's SDPA to the top left
        return "causal with query and key lengths that differ (the masks' alignments differ)"
    if q.device.type != "cuda":
        return f"tensors are on {q.device.type}, not a CUDA GPU"
    return None


def _hopper_only(*args: Any) -> str | None:
    # Selection already passes flash_attn_3 over off Hopper (its `architectures`), so the
    # next candidate runs there; this per-call check only guards a device whose
    # DeviceInfo says Hopper when torch says otherwise (hardware.nvidia.architecture set
    # on a GPU the table does not know).
    reason = _declines(*args)
    if reason is None and torch.cuda.get_device_capability(args[0].device)[0] != 9:
        return "flash-attn 3 kernels are built for Hopper (sm_90) only"
    return reason


def _run(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
         scale: float | None) -> torch.Tensor:
    out = module.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 softmax_scale=scale, causal=is_causal)
    out = out[0] if isinstance(out, tuple) else out
    result: torch.Tensor = out.transpose(1, 2).contiguous()
    return result


def flash_attn_3(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    import flash_attn_interface

    return _run(flash_attn_interface, q, k, v, is_causal, scale)


def flash_attn_2(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
                 is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    import flash_attn

    return _run(flash_attn, q, k, v, is_causal, scale)


def _missing(module: str, package: str) -> str | None:
    return None if importlib.util.find_spec(module) is not None else \
        f"{package} is not installed"


@functools.cache
def implementations() -> list[KernelImplementation]:
    # Made once: the same objects each call, so each gets one wrapper op.
    return [
        # flash-attn README: FlashAttention-3 is for Hopper (H100/H800); FlashAttention-2
        # for Ampere, Ada and Hopper, fp16/bf16, head dimensions up to 256.
        # flash_attn_3 names its architecture, not only a least capability: Blackwell
        # (10.x, 12.x) is above 9.0 but has no flash-attn 3 kernels, and a candidate that
        # declines every call would keep flash_attn_2 from being chosen.
        KernelImplementation(
            "scaled_dot_product_attention", "flash_attn_3", flash_attn_3, backends=("cuda",),
            dtypes=HALF, min_capability=FLASH_ATTN_3_MIN_CAPABILITY,
            architectures=FLASH_ATTN_3_ARCHITECTURES, declines=_hopper_only, priority=2,
            unavailable=_missing("flash_attn_interface", "flash-attn 3 (flash_attn_interface)"),
            description="FlashAttention-3 on Hopper"),
        KernelImplementation(
            "scaled_dot_product_attention", "flash_attn_2", flash_attn_2, backends=("cuda",),
            dtypes=HALF, min_capability=FLASH_ATTN_2_MIN_CAPABILITY, declines=_declines,
            priority=1,
            unavailable=_missing("flash_attn", "flash-attn 2 (flash_attn)"),
            description="FlashAttention-2"),
        # FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards (architecture.FP8_SINCE;
        # torch's _scaled_mm_allowed_device in ScaledBlas.cpp). The architectures too: a
        # capability not in the plugin's table is described with no FP8 (as the fp8_linear
        # pass and the quantize gate take it), so the kernel is not chosen there either.
        fp8_linear_implementation("cuda_fp8_linear_e4m3", torch.float8_e4m3fn,
                                  backends=("cuda",), min_capability=FP8_MIN_CAPABILITY,
                                  architectures=FP8_ARCHITECTURES),
    ]
