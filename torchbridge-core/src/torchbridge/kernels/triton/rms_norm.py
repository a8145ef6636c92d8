# Triton jit kernels take untyped arguments (Triton reads `tl.constexpr` annotations itself):
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""RMSNorm forward and backward, and the fused residual add + RMSNorm, one program per row.

y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension. Every
load is widened to float32 before any arithmetic (Triton's interpreter computes bfloat16
arithmetic wrongly, and float32 is what the reference computes in); stores narrow to the
output's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchbridge.errors import KernelError
from torchbridge.kernels.triton._launch import (
    AOT_VARIANTS,
    AotSpec,
    as_rows,
    block_problem,
    check,
    device_problem,
    dtype_problem,
    num_warps,
    on_device,
    row_block,
)


@triton.jit
def rms_norm_forward_kernel(x_ptr, weight_ptr, y_ptr, rstd_ptr, x_row_stride, y_row_stride,
                            n_cols, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_backward_kernel(grad_y_ptr, x_ptr, weight_ptr, rstd_ptr, grad_sum_ptr,
                             grad_x_ptr, grad_weight_partial_ptr, grad_y_row_stride,
                             x_row_stride, grad_sum_row_stride, grad_x_row_stride, n_rows,
                             n_cols, rows_per_program, eps, HAS_WEIGHT: tl.constexpr,
                             FUSED_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """Each program takes `rows_per_program` consecutive rows and writes its share of
    grad_weight (summed over its rows, in float32) to one row of the partial buffer; the
    caller adds the partial rows. With g = grad_y * weight:
    grad_x = rstd * g - rstd^3 * x * sum(g * x) / n_cols.
    FUSED_ADD is the backward of the residual add + RMSNorm, where x is the sum: rstd is
    recomputed from it (with eps; the forward saves none) and the gradient that reached the
    sum directly is added. x and residual both get that gradient."""
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK], dtype=tl.float32)
    first = program * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for row in range(first, last):
        grad_y = tl.load(grad_y_ptr + row * grad_y_row_stride + cols, mask=mask,
                         other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        if FUSED_ADD:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        else:
            rstd = tl.load(rstd_ptr + row)
        if HAS_WEIGHT:
            g = grad_y * weight
            grad_weight += grad_y * x * rstd
        else:
            g = grad_y
        grad_x = rstd * g - rstd * rstd * rstd * x * (tl.sum(g * x, axis=0) / n_cols)
        if FUSED_ADD:
            grad_x += tl.load(grad_sum_ptr + row * grad_sum_row_stride + cols, mask=mask,
                              other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + row * grad_x_row_stride + cols,
                 grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHT:
        tl.store(grad_weight_partial_ptr + program * n_cols + cols, grad_weight, mask=mask)


@triton.jit
def add_rms_norm_forward_kernel(x_ptr, residual_ptr, weight_ptr, y_ptr, sum_ptr,
                                x_row_stride, residual_row_stride, y_row_stride,
                                sum_row_stride, n_cols, eps, HAS_WEIGHT: tl.constexpr,
                                BLOCK: tl.constexpr):
    """s = x + residual rounded to the input dtype (what an unfused model carries on), then
    y = rms_norm(s) * weight computed from that rounded s, so the fusion changes no bit of
    the residual stream."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask,
                       other=0.0).to(tl.float32)
    total = (x + residual).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * sum_row_stride + cols, total, mask=mask)
    s = total.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, axis=0) / n_cols + eps)
    y = s * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _weight_problem(x: torch.Tensor, weight: torch.Tensor | None) -> str | None:
    if weight is None:
        return None
    if tuple(weight.shape) != (x.shape[-1],):
        return f"weight has shape {tuple(weight.shape)}; the kernel needs ({x.shape[-1]},)"
    return dtype_problem(weight=weight)


def rms_norm_problem(x: torch.Tensor, weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> str | None:
    """Why the kernel declines this call (the reference then runs), or None."""
    if x.dim() == 0:
        return "x is a scalar; RMSNorm needs a last dimension"
    tensors = [x] if weight is None else [x, weight]
    return (dtype_problem(x=x) or _weight_problem(x, weight) or device_problem(*tensors)
            or block_problem(x.shape[-1]))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x * rstd * weight in x's dtype (shape of x, contiguous), rstd the
    float32 per-row 1 / sqrt(mean(x^2) + eps), shape x.shape[:-1], kept for backward."""
    check(rms_norm_problem(x, weight, eps))
    rows = as_rows(x)
    n_rows, n_cols = rows.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        block = row_block(n_cols)
        with on_device(x):
            rms_norm_forward_kernel[(n_rows,)](
                rows, rows if weight is None else weight.contiguous(), y, rstd, rows.stride(0),
                y.stride(0), n_cols, eps, HAS_WEIGHT=weight is not None, BLOCK=block,
                num_warps=num_warps(block))
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _programs(n_rows: int, x: torch.Tensor) -> int:
    """How many programs share the backward's rows: enough to fill the device, few enough
    that the grad_weight partials stay small."""
    if x.device.type == "cuda":
        slots = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        slots = 64
    return max(1, min(n_rows, slots))


def _backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
              rstd: torch.Tensor | None, grad_sum: torch.Tensor | None, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel: with rstd (rms_norm), or recomputing it from x and adding
    grad_sum (add_rms_norm, rstd None)."""
    rows, grad_rows = as_rows(x), as_rows(grad_y)
    n_rows, n_cols = rows.shape
    if rstd is not None:
        rstd = rstd.reshape(-1).to(torch.float32).contiguous()
        if rstd.numel() != n_rows:
            raise KernelError(f"rstd has {rstd.numel()} values for {n_rows} rows")
    grad_sum_rows = None if grad_sum is None else as_rows(grad_sum)
    grad_x = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    programs = _programs(n_rows, x)
    rows_per_program = triton.cdiv(n_rows, programs)
    partial = torch.zeros((programs if weight is not None else 1, n_cols),
                          dtype=torch.float32, device=x.device)
    if n_rows:
        block = row_block(n_cols)
        with on_device(x):
            rms_norm_backward_kernel[(programs,)](
                grad_rows, rows, rows if weight is None else weight.contiguous(),
                partial if rstd is None else rstd,
                rows if grad_sum_rows is None else grad_sum_rows, grad_x, partial,
                grad_rows.stride(0), rows.stride(0),
                0 if grad_sum_rows is None else grad_sum_rows.stride(0), grad_x.stride(0),
                n_rows, n_cols, rows_per_program, eps, HAS_WEIGHT=weight is not None,
                FUSED_ADD=rstd is None, BLOCK=block, num_warps=num_warps(block))
    grad_weight = None if weight is None else partial.sum(dim=0).to(weight.dtype)
    return grad_x.view(x.shape), grad_weight


def _same_shape(name: str, tensor: torch.Tensor, x: torch.Tensor) -> None:
    if tensor.shape != x.shape:
        raise KernelError(f"{name} has shape {tuple(tensor.shape)}, the input "
                          f"{tuple(x.shape)}")


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_x in x's dtype, grad_weight in weight's dtype or None without a weight), from
    the forward's rstd. grad_weight is accumulated in float32 over all rows."""
    check(rms_norm_problem(x, weight) or dtype_problem(grad_y=grad_y)
          or device_problem(x, grad_y, rstd))
    _same_shape("grad_y", grad_y, x)
    return _backward(grad_y, x, weight, rstd, None, 0.0)


def add_rms_norm_problem(x: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor | None = None, eps: float = 1e-6) -> str | None:
    """Why the fused kernel declines this call, or None. x and residual must have one shape
    and dtype (the kernel does not broadcast the residual)."""
    if x.shape != residual.shape:
        return (f"x has shape {tuple(x.shape)} and residual {tuple(residual.shape)}; "
                "the fused kernel needs them equal")
    if x.dtype != residual.dtype:
        return f"x is {x.dtype} and residual {residual.dtype}; the fused kernel needs one dtype"
    return rms_norm_problem(x, weight, eps) or device_problem(x, residual)


def add_rms_norm_forward(x: torch.Tensor, residual: torch.Tensor,
                         weight: torch.Tensor | None, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), both in x's dtype, in one pass over
    the row. The sum is rounded to x's dtype before the norm, as an unfused model does."""
    check(add_rms_norm_problem(x, residual, weight, eps))
    rows, residual_rows = as_rows(x), as_rows(residual)
    n_rows, n_cols = rows.shape
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    total = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows:
        block = row_block(n_cols)
        with on_device(x):
            add_rms_norm_forward_kernel[(n_rows,)](
                rows, residual_rows, rows if weight is None else weight.contiguous(), y, total,
                rows.stride(0), residual_rows.stride(0), y.stride(0), total.stride(0),
                n_cols, eps, HAS_WEIGHT=weight is not None, BLOCK=block,
                num_warps=num_warps(block))
    return y.view(x.shape), total.view(x.shape)


def add_rms_norm_backward(grad_y: torch.Tensor, grad_sum: torch.Tensor, total: torch.Tensor,
                          weight: torch.Tensor | None, eps: float
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward of add_rms_norm_forward from its returned sum `total` (rstd is
    recomputed from it, so the forward saves nothing more): (the gradient w.r.t. x, which is
    also the gradient w.r.t. residual, in the input dtype; grad_weight in weight's dtype or
    None). grad_sum is the gradient that reached the returned sum directly."""
    check(rms_norm_problem(total, weight, eps)
          or dtype_problem(grad_y=grad_y, grad_sum=grad_sum)
          or device_problem(total, grad_y, grad_sum))
    _same_shape("grad_y", grad_y, total)
    _same_shape("grad_sum", grad_sum, total)
    return _backward(grad_y, total, weight, None, grad_sum, eps)


def aot_specs(block: int = 4096) -> list[AotSpec]:
    """Compiles of each kernel with and without a weight (the backward also with and without
    the fused add), at a typical width."""
    specs = []
    for triton_dtype, has_weight in AOT_VARIANTS:
        pointer = f"*{triton_dtype}"
        constexprs = {"HAS_WEIGHT": has_weight, "BLOCK": block}
        specs.append(AotSpec(rms_norm_forward_kernel, {
            "x_ptr": pointer, "weight_ptr": pointer, "y_ptr": pointer, "rstd_ptr": "*fp32",
            "x_row_stride": "i32", "y_row_stride": "i32", "n_cols": "i32", "eps": "fp32",
            "HAS_WEIGHT": "constexpr", "BLOCK": "constexpr"}, constexprs))
        for fused_add in (False, True):
            specs.append(AotSpec(rms_norm_backward_kernel, {
                "grad_y_ptr": pointer, "x_ptr": pointer, "weight_ptr": pointer,
                "rstd_ptr": "*fp32", "grad_sum_ptr": pointer, "grad_x_ptr": pointer,
                "grad_weight_partial_ptr": "*fp32", "grad_y_row_stride": "i32",
                "x_row_stride": "i32", "grad_sum_row_stride": "i32",
                "grad_x_row_stride": "i32", "n_rows": "i32", "n_cols": "i32",
                "rows_per_program": "i32", "eps": "fp32", "HAS_WEIGHT": "constexpr",
                "FUSED_ADD": "constexpr", "BLOCK": "constexpr"},
                {**constexprs, "FUSED_ADD": fused_add}))
        specs.append(AotSpec(add_rms_norm_forward_kernel, {
            "x_ptr": pointer, "residual_ptr": pointer, "weight_ptr": pointer,
            "y_ptr": pointer, "sum_ptr": pointer, "x_row_stride": "i32",
            "residual_row_stride": "i32", "y_row_stride": "i32", "sum_row_stride": "i32",
            "n_cols": "i32", "eps": "fp32", "HAS_WEIGHT": "constexpr",
            "BLOCK": "constexpr"}, constexprs))
    return specs


def rms_norm_aot_specs() -> list[AotSpec]:
    return [spec for spec in aot_specs() if spec.kernel is rms_norm_forward_kernel or
            (spec.kernel is rms_norm_backward_kernel and not spec.constexprs["FUSED_ADD"])]


def add_rms_norm_aot_specs() -> list[AotSpec]:
    return [spec for spec in aot_specs() if spec.kernel is add_rms_norm_forward_kernel or
            (spec.kernel is rms_norm_backward_kernel and spec.constexprs["FUSED_ADD"])]
