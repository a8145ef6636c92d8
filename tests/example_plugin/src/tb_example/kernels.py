"""The example backend's kernels, as a vendor would write them: a trainable rms_norm for
its backend, a deliberately wrong silu_mul (the correctness gate must refuse it), and an
op of its own, `scale_shift`, with a module pattern so prepare_model uses it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchbridge import KernelImplementation, ModulePattern, OpDefinition


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    x32 = x.float()
    out = x32 / torch.sqrt(x32.square().mean(-1, keepdim=True) + eps)
    return (out * weight.float() if weight is not None else out).to(x.dtype)


def rms_norm_backward(inputs: tuple[Any, ...], output: torch.Tensor, grad: torch.Tensor
                      ) -> tuple[Any, ...]:
    x, weight, eps = inputs
    x32, g32 = x.float(), grad.float()
    rstd = torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    normed = x32 * rstd
    w = weight.float() if weight is not None else torch.ones_like(x32[..., 0:1])
    gn = g32 * w
    grad_x = rstd * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    grad_w = (g32 * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype) \
        if weight is not None else None
    return grad_x.to(x.dtype), grad_w, None


def wrong_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.relu(gate) * up  # not silu: the gate must catch it


def scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The example op's reference: x * scale + shift."""
    return x * scale + shift


def fused_scale_shift(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
                      ) -> torch.Tensor:
    return torch.addcmul(shift, x, scale)


class ScaleShift(nn.Module):
    """A module the example vendor's users have in their models."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.shift = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def _match(module: nn.Module) -> dict[str, Any] | None:
    return {"width": module.scale.shape[0]} if isinstance(module, ScaleShift) else None


def _forward(module: nn.Module, kernel: Any, facts: dict[str, Any], x: torch.Tensor
             ) -> torch.Tensor:
    out: torch.Tensor = kernel(x, module.scale, module.shift)
    return out


def _example_input(module: nn.Module, facts: dict[str, Any], dtype: torch.dtype
                   ) -> tuple[Any, ...]:
    return (torch.randn(2, 4, facts["width"], dtype=dtype),)


OPS = [OpDefinition("scale_shift", scale_shift,
                    "(Tensor x, Tensor scale, Tensor shift) -> Tensor", "x * scale + shift")]
PATTERNS = [ModulePattern("scale_shift", "scale_shift", _match, _forward, _example_input,
                          "tb_example.kernels.ScaleShift")]
IMPLEMENTATIONS = [
    KernelImplementation("rms_norm", "example_rms_norm_trainable", rms_norm, rms_norm_backward,
                         backends=("example",), dtypes=(torch.float32, torch.bfloat16),
                         priority=1, description="the Example NPU's rms_norm"),
    KernelImplementation("silu_mul", "example_wrong_silu_mul", wrong_silu_mul,
                         backends=("example",), description="deliberately wrong"),
    KernelImplementation("scale_shift", "example_fused_scale_shift", fused_scale_shift,
                         backends=("example",), traceable=True, differentiable=True,
                         description="addcmul: one kernel"),
]
