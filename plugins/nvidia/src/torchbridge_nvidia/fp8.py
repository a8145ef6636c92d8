"""Real FP8 inference on NVIDIA GPUs: e4m3 weights and activations with per-tensor scales,
matmul in torch._scaled_mm (FP8 tensor cores on Ada, 8.9, and newer). The layer itself is the
core's (`torchbridge.fp8`, shared with the AMD plugin, which uses it with gfx94x's fnuz
dtype); this module adds Transformer Engine, used instead when it is installed and the model
is on a GPU, and the seed's FP8Compiler. torch._scaled_mm has no backward, so without
Transformer Engine these layers are for inference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchbridge import fp8 as core_fp8
from torchbridge.fp8 import ALIGNMENT, FP8CompilationResult, convert_linears_to_fp8
from torchbridge.optimize.forward import install_forward

from torchbridge_nvidia.architecture import FP8_MIN_CAPABILITY
from torchbridge_nvidia.errors import FP8CompilationError, InvalidComputeCapabilityError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, dequantization scale): x ~= q.float() * scale."""
    return core_fp8.quantize_fp8(x, E4M3)


class FP8Linear(core_fp8.FP8Linear):
    """The core's FP8Linear (e4m3 by default), raising the NVIDIA plugin's
    FP8CompilationError."""

    error = FP8CompilationError


def _transformer_engine() -> Any | None:
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


def under_fp8_autocast(model: nn.Module, te: Any) -> None:
    """Runs `model` (its linears te.Linear) inside te.fp8_autocast, through a forward of its
    own rather than a wrapper module: a prepared model keeps the class and state_dict keys
    of the model given (a pass returning a wrapper is rolled back)."""
    def make(inner: Any) -> Any:
        def forward(*args: Any, **kwargs: Any) -> Any:
            with te.fp8_autocast(enabled=True):
                return inner(*args, **kwargs)
        return forward

    install_forward(model, make, lambda twin: under_fp8_autocast(twin, te))


def _te_linear(te: Any, linear: nn.Linear) -> nn.Module:
    layer: Any = te.Linear(linear.in_features, linear.out_features,
                           bias=linear.bias is not None, params_dtype=linear.weight.dtype,
                           device=linear.weight.device)
    with torch.no_grad():
        layer.weight.copy_(linear.weight)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
    module: nn.Module = layer
    return module


def gpu_capability(model: nn.Module) -> tuple[int, int] | None:
    """(major, minor) of the GPU the model's parameters are on; None on the CPU."""
    device = next((p.device for p in model.parameters() if p.is_cuda), None)
    if device is None:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def _check_capability(capability: tuple[int, int]) -> None:
    # torch._scaled_mm refuses older GPUs only at the first forward (ScaledBlas.cpp); say so
    # at conversion, with the fix.
    if capability < FP8_MIN_CAPABILITY:
        raise InvalidComputeCapabilityError(
            f"FP8 linears need FP8 tensor cores (compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}, Ada, or newer); this GPU is "
            f"{capability[0]}.{capability[1]}. Use bf16 or fp16 autocast instead")


class FP8Compiler:
    """`FP8Compiler().compile_with_fp8(model)` swaps every eligible nn.Linear (dimensions
    divisible by 16) for an FP8 layer, in place, and reports coverage. A model on a GPU
    older than compute capability 8.9 raises InvalidComputeCapabilityError."""

    def __init__(self, config: Any = None, *, use_transformer_engine: bool | None = None
                 ) -> None:
        self.config = config
        self.use_transformer_engine = use_transformer_engine

    def compile_with_fp8(self, model: nn.Module, for_inference: bool = True
                         ) -> FP8CompilationResult:
        if not isinstance(model, nn.Module):
            raise FP8CompilationError(f"expected an nn.Module, got {type(model).__name__}")
        capability = gpu_capability(model)
        if capability is not None:
            _check_capability(capability)
        on_gpu = capability is not None
        te = _transformer_engine() if self.use_transformer_engine is not False and on_gpu \
            else None
        if self.use_transformer_engine and te is None:
            raise FP8CompilationError("use_transformer_engine=True, but transformer_engine "
                                      "is not installed or the model is not on a GPU")
        if not for_inference and te is None:
            raise FP8CompilationError("FP8 training needs Transformer Engine "
                                      "(pip install transformer-engine); torch._scaled_mm "
                                      "has no backward")
        make = (lambda linear: _te_linear(te, linear)) if te else FP8Linear.from_linear
        result = convert_linears_to_fp8(
            model, E4M3, make, "transformer_engine" if te else "torch._scaled_mm",
            FP8CompilationError)
        if te is not None and result.fp8_layers:
            under_fp8_autocast(model, te)
        return result

    @staticmethod
    def get_fp8_stats(model: nn.Module) -> dict[str, Any]:
        """{"fp8_layers", "linear_layers", "fp8_coverage"}: coverage by weight count."""
        return core_fp8.fp8_stats(model)


__all__ = ["ALIGNMENT", "E4M3", "E4M3_MAX", "FP8CompilationResult", "FP8Compiler", "FP8Linear",
           "quantize_e4m3"]
