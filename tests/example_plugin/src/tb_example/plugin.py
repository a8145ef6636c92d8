"""Overrides a built-in kernel, adds a pass and can veto one, reading the section that the
example backend contributes (`config.hardware.example`)."""

from __future__ import annotations

from typing import Any

import torch
from torchbridge import OptimizationLevel, OptimizationPass, hookimpl


def example_rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
                     ) -> torch.Tensor:
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return out * weight if weight is not None else out


example_rms_norm.provided_by = "tb_example"  # type: ignore[attr-defined]


@hookimpl(tryfirst=True)
def torchbridge_kernel(op: str, backend_name: str) -> Any:
    """The first contract: a plain callable (inference only, opaque to compile)."""
    return example_rms_norm if op == "rms_norm" else None


@hookimpl
def torchbridge_ops() -> list[Any]:
    from tb_example.kernels import OPS

    return OPS


@hookimpl
def torchbridge_kernel_implementations(backend: Any) -> list[Any] | None:
    from tb_example.kernels import IMPLEMENTATIONS

    return IMPLEMENTATIONS


@hookimpl
def torchbridge_module_patterns(backend: Any) -> list[Any]:
    from tb_example.kernels import PATTERNS

    return PATTERNS


def _tag(model: torch.nn.Module, ctx: Any) -> torch.nn.Module:
    model.tagged_by_example = True  # type: ignore[assignment]
    return model


def _tag_check(model: torch.nn.Module, ctx: Any) -> str | None:
    if not ctx.config.hardware.example.tag_models:
        return "config hardware.example.tag_models is off"
    return None


@hookimpl(tryfirst=True)
def torchbridge_optimization_passes(backend: Any, level: OptimizationLevel) -> list[Any]:
    passes = [OptimizationPass("example_tag", "tagged the model for the example plugin",
                               OptimizationLevel.O1, _tag, check=_tag_check, order=45)]
    veto = backend.config.hardware.example.veto_pass
    if veto:
        passes.append(OptimizationPass.veto(veto, "the example plugin says no"))
    return passes
