"""Built-in plugin "triton": the core's Triton kernels as implementations for the backends
Triton compiles for (cuda, rocm, xpu), and for cpu under Triton's interpreter
(TRITON_INTERPRET=1, which runs kernels on CPU tensors: how CI checks them).

Triton is optional (`pip install torchbridge-core[triton]`). The implementations are always
listed, so doctor can say why they do not run; triton itself is imported at the first call
of a kernel, never at discovery. The kernels are in `torchbridge.kernels.triton`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import TYPE_CHECKING, Any

from torchbridge.hookspecs import hookimpl
from torchbridge.kernels.compute import TRITON_BACKENDS

if TYPE_CHECKING:
    from torchbridge.backend import Backend
    from torchbridge.kernels.implementations import KernelImplementation

def triton_backends() -> tuple[str, ...]:
    """The backends the Triton kernels serve in this process."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    return TRITON_BACKENDS + (("cpu",) if interpreted else ())


def _kernels() -> Any:
    from torchbridge.kernels import triton as kernels

    return kernels


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    return _kernels().rms_norm_forward(x, weight, eps)[0]


def rms_norm_backward(inputs: tuple[Any, ...], output: Any, grad: Any) -> tuple[Any, ...]:
    x, weight, eps = inputs
    kernels = _kernels()
    _, rstd = kernels.rms_norm_forward(x, weight, eps)
    grad_x, grad_weight = kernels.rms_norm_backward(grad, x, weight, rstd)
    return grad_x, grad_weight, None


def rms_norm_declines(x: Any, weight: Any, eps: float) -> str | None:
    problem: str | None = _kernels().rms_norm_problem(x, weight, eps)
    return problem


def silu_mul(gate: Any, up: Any) -> Any:
    return _kernels().silu_mul_forward(gate, up)


def silu_mul_backward(inputs: tuple[Any, ...], output: Any, grad: Any) -> tuple[Any, ...]:
    return tuple(_kernels().silu_mul_backward(grad, *inputs))


def silu_mul_declines(gate: Any, up: Any) -> str | None:
    problem: str | None = _kernels().silu_mul_problem(gate, up)
    return problem


def rotary(x: Any, cos: Any, sin: Any) -> Any:
    return _kernels().rotary_forward(x, cos, sin)


def rotary_backward(inputs: tuple[Any, ...], output: Any, grad: Any) -> tuple[Any, ...]:
    _, cos, sin = inputs
    return _kernels().rotary_backward(grad, cos, sin), None, None


def rotary_declines(x: Any, cos: Any, sin: Any) -> str | None:
    if cos.requires_grad or sin.requires_grad:
        return "cos or sin requires grad; the kernel's backward is for x only"
    problem: str | None = _kernels().rotary_problem(x, cos, sin)
    return problem


def add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> Any:
    return _kernels().add_rms_norm_forward(x, residual, weight, eps)


def add_rms_norm_backward(inputs: tuple[Any, ...], output: Any, grad_y: Any, grad_sum: Any
                          ) -> tuple[Any, ...]:
    _, _, weight, eps = inputs
    grad_x, grad_weight = _kernels().add_rms_norm_backward(grad_y, grad_sum, output[1],
                                                           weight, eps)
    return grad_x, grad_x, grad_weight, None  # x and residual enter as their sum


def add_rms_norm_declines(x: Any, residual: Any, weight: Any, eps: float) -> str | None:
    problem: str | None = _kernels().add_rms_norm_problem(x, residual, weight, eps)
    return problem


@functools.cache
def implementations(backends: tuple[str, ...]) -> tuple[KernelImplementation, ...]:
    """Made once per set of backends: the same objects each time, so each gets one wrapper
    op and torch.compile sees the same op."""
    import torch

    from torchbridge.kernels.implementations import KernelImplementation

    missing = None if importlib.util.find_spec("triton") is not None else \
        "triton is not installed (pip install torchbridge-core[triton])"
    common: dict[str, Any] = {"backends": backends, "unavailable": missing,
                              "dtypes": (torch.float32, torch.float16, torch.bfloat16)}
    return (
        KernelImplementation("rms_norm", "triton_rms_norm", rms_norm, rms_norm_backward,
                             declines=rms_norm_declines,
                             description="one program per row, float32 inside", **common),
        KernelImplementation("silu_mul", "triton_silu_mul", silu_mul, silu_mul_backward,
                             declines=silu_mul_declines,
                             description="elementwise, float32 inside", **common),
        KernelImplementation("rotary_embedding", "triton_rotary", rotary, rotary_backward,
                             declines=rotary_declines,
                             description="Hugging Face rotate_half convention", **common),
        KernelImplementation("add_rms_norm", "triton_add_rms_norm", add_rms_norm,
                             add_rms_norm_backward, declines=add_rms_norm_declines,
                             description="residual add and rms_norm in one pass", **common),
    )


@hookimpl(trylast=True)
def torchbridge_kernel_implementations(backend: Backend) -> list[KernelImplementation]:
    return list(implementations(triton_backends()))
