# Triton jit kernels take untyped arguments (Triton reads `tl.constexpr` annotations itself):
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Rotary position embedding, Hugging Face's convention (rotate_half, not interleaved pairs):

    out = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])

x is (batch, heads, seq, head_dim), any strides with a unit last stride (the (B, S, H, D)
projection transposed to (B, H, S, D), as HF models make it, runs without a copy). cos and sin
are (B, S, D), (1, S, D), (S, D) or with a singleton head dim (B, 1, S, D), shared by every
head. One program takes one (batch, position) and a block of heads, loads that position's
cos and sin once, and rotates both halves of each head.

Backward: with R = rotate_half as a matrix, out = cos * x + sin * (R x), so
grad_x = cos * g + R^T (sin * g), and R^T = -R: grad_x = g * cos - rotate_half(g * sin). By
halves: grad_x1 = g1 c1 + g2 s2, grad_x2 = g2 c2 - g1 s1. (That equals rotary(g, cos, -sin)
only when both halves of cos and of sin are equal, as in HF's tables; this kernel does not
assume it.) The gradient w.r.t. cos and sin is not computed: they are position tables.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchbridge.kernels.triton._launch import (
    AOT_VARIANTS,
    AotSpec,
    block_problem,
    check,
    device_problem,
    dtype_problem,
    on_device,
)

MAX_BLOCK_HEADS = 16


@triton.jit
def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, seq_len, n_heads, half,
                  x_stride_b, x_stride_h, x_stride_s, cos_stride_b, cos_stride_s,
                  sin_stride_b, sin_stride_s, out_stride_b, out_stride_h, out_stride_s,
                  BACKWARD: tl.constexpr, BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = row // seq_len
    s = row % seq_len
    heads = tl.program_id(1).to(tl.int64) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    mask = (heads[:, None] < n_heads) & col_mask[None, :]

    cos_row = cos_ptr + b * cos_stride_b + s * cos_stride_s
    sin_row = sin_ptr + b * sin_stride_b + s * sin_stride_s
    cos1 = tl.load(cos_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_row + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_row + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_row + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]

    x_rows = x_ptr + b * x_stride_b + s * x_stride_s + heads[:, None] * x_stride_h
    x1 = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_rows + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        out1 = x1 * cos1 + x2 * sin2
        out2 = x2 * cos2 - x1 * sin1
    else:
        out1 = x1 * cos1 - x2 * sin1
        out2 = x2 * cos2 + x1 * sin2
    out_rows = out_ptr + b * out_stride_b + s * out_stride_s + heads[:, None] * out_stride_h
    tl.store(out_rows + cols[None, :], out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_rows + half + cols[None, :], out2.to(out_ptr.dtype.element_ty), mask=mask)


def _table_problem(name: str, table: torch.Tensor, x: torch.Tensor) -> str | None:
    batch, _, seq_len, head_dim = x.shape
    shape = tuple(table.shape)
    if table.dim() == 4:
        if shape[1] != 1:
            return f"{name} has shape {shape}; a 4-d table needs a singleton head dim"
        shape = shape[:1] + shape[2:]
    elif table.dim() == 2:
        shape = (1, *shape)
    elif table.dim() != 3:
        return f"{name} has shape {tuple(table.shape)}; expected (B, S, D), (S, D) or (B, 1, S, D)"
    if shape[1:] != (seq_len, head_dim) or shape[0] not in (1, batch):
        return (f"{name} has shape {tuple(table.shape)}, which does not broadcast over x's "
                f"(batch, seq, head_dim) = ({batch}, {seq_len}, {head_dim})")
    return None


def rotary_problem(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """Why the kernel declines this call (the reference then runs), or None."""
    if x.dim() != 4:
        return f"x has shape {tuple(x.shape)}; the kernel takes (batch, heads, seq, head_dim)"
    if x.shape[-1] % 2:
        return f"head_dim {x.shape[-1]} is odd; rotate_half needs two equal halves"
    if cos.shape != sin.shape:
        return f"cos has shape {tuple(cos.shape)} and sin {tuple(sin.shape)}"
    return (dtype_problem(x=x, cos=cos, sin=sin) or _table_problem("cos", cos, x)
            or device_problem(x, cos, sin) or block_problem(x.shape[-1]))


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _table(table: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The table as (B or 1, S, D) with a unit last stride, its batch and seq strides (batch
    stride 0 when one table serves every batch)."""
    if table.dim() == 4:
        table = table[:, 0]
    elif table.dim() == 2:
        table = table[None]
    table = _unit_last_stride(table)
    return table, (0 if table.shape[0] == 1 else table.stride(0)), table.stride(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool
            ) -> torch.Tensor:
    check(rotary_problem(x, cos, sin))
    x = _unit_last_stride(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not out.numel():
        return out
    batch, n_heads, seq_len, head_dim = x.shape
    cos, cos_stride_b, cos_stride_s = _table(cos)
    sin, sin_stride_b, sin_stride_s = _table(sin)
    block_heads = min(int(triton.next_power_of_2(n_heads)), MAX_BLOCK_HEADS)
    grid = (batch * seq_len, triton.cdiv(n_heads, block_heads))
    with on_device(x):
        rotary_kernel[grid](
            x, cos, sin, out, seq_len, n_heads, head_dim // 2,
            x.stride(0), x.stride(1), x.stride(2), cos_stride_b, cos_stride_s,
            sin_stride_b, sin_stride_s, out.stride(0), out.stride(1), out.stride(2),
            BACKWARD=backward, BLOCK_HEADS=block_heads,
            BLOCK_HALF=int(triton.next_power_of_2(head_dim // 2)))
    return out


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, contiguous, in x's dtype (cos and sin may be another
    supported dtype; they are read as float32)."""
    return _rotate(x, cos, sin, backward=False)


def rotary_backward(grad: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient w.r.t. x: grad * cos - rotate_half(grad * sin), in grad's dtype."""
    return _rotate(grad, cos, sin, backward=True)


def aot_specs(head_dim: int = 128) -> list[AotSpec]:
    specs = []
    for triton_dtype, forward in AOT_VARIANTS:
        pointer = f"*{triton_dtype}"
        signature = {"x_ptr": pointer, "cos_ptr": pointer, "sin_ptr": pointer,
                     "out_ptr": pointer}
        signature.update(dict.fromkeys((
            "seq_len", "n_heads", "half", "x_stride_b", "x_stride_h", "x_stride_s",
            "cos_stride_b", "cos_stride_s", "sin_stride_b", "sin_stride_s",
            "out_stride_b", "out_stride_h", "out_stride_s"), "i32"))
        signature.update(dict.fromkeys(("BACKWARD", "BLOCK_HEADS", "BLOCK_HALF"),
                                       "constexpr"))
        specs.append(AotSpec(rotary_kernel, signature, {
            "BACKWARD": not forward, "BLOCK_HEADS": MAX_BLOCK_HEADS,
            "BLOCK_HALF": head_dim // 2}))
    return specs
