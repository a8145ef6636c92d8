# Triton jit kernels take untyped arguments (Triton reads `tl.constexpr` annotations itself):
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""SwiGLU's gating, silu(gate) * up, and its backward: elementwise over the flattened
tensors, a fixed block per program, float32 arithmetic after each load."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchbridge.kernels.triton._launch import (
    AOT_DTYPES,
    AotSpec,
    check,
    device_problem,
    dtype_problem,
    on_device,
)

BLOCK = 1024


@triton.jit
def silu_mul_forward_kernel(gate_ptr, up_ptr, out_ptr, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_backward_kernel(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr, grad_up_ptr,
                             n_elements, BLOCK: tl.constexpr):
    """d/d gate = grad * up * sigmoid(g) * (1 + g * (1 - sigmoid(g)));
    d/d up = grad * silu(g)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    grad_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    grad_up = grad * gate * sigmoid
    tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_up_ptr + offsets, grad_up.to(grad_up_ptr.dtype.element_ty), mask=mask)


def silu_mul_problem(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why the kernel declines this call (the reference then runs), or None. The kernel
    does not broadcast: gate and up need one shape and one dtype."""
    if gate.shape != up.shape:
        return (f"gate has shape {tuple(gate.shape)} and up {tuple(up.shape)}; "
                "the kernel needs them equal")
    if gate.dtype != up.dtype:
        return f"gate is {gate.dtype} and up {up.dtype}; the kernel needs one dtype"
    return dtype_problem(gate=gate) or device_problem(gate, up)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in the inputs' dtype (contiguous, gate's shape)."""
    check(silu_mul_problem(gate, up))
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        with on_device(gate):
            silu_mul_forward_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, BLOCK=BLOCK)
    return out


def silu_mul_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_gate, grad_up) in the inputs' dtype."""
    check(silu_mul_problem(gate, up) or silu_mul_problem(grad, gate))
    grad, gate, up = grad.contiguous(), gate.contiguous(), up.contiguous()
    grad_gate = torch.empty_like(gate, memory_format=torch.contiguous_format)
    grad_up = torch.empty_like(up, memory_format=torch.contiguous_format)
    n = gate.numel()
    if n:
        with on_device(gate):
            silu_mul_backward_kernel[(triton.cdiv(n, BLOCK),)](
                grad, gate, up, grad_gate, grad_up, n, BLOCK=BLOCK)
    return grad_gate, grad_up


def aot_specs() -> list[AotSpec]:
    specs = []
    for triton_dtype in AOT_DTYPES:
        pointer = f"*{triton_dtype}"
        specs.append(AotSpec(silu_mul_forward_kernel, {
            "gate_ptr": pointer, "up_ptr": pointer, "out_ptr": pointer, "n_elements": "i32",
            "BLOCK": "constexpr"}, {"BLOCK": BLOCK}))
        specs.append(AotSpec(silu_mul_backward_kernel, {
            "grad_ptr": pointer, "gate_ptr": pointer, "up_ptr": pointer,
            "grad_gate_ptr": pointer, "grad_up_ptr": pointer, "n_elements": "i32",
            "BLOCK": "constexpr"}, {"BLOCK": BLOCK}))
    return specs
