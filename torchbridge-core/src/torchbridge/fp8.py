"""FP8 linear layers shared by the vendor plugins, parameterised by FP8 dtype.

NVIDIA (Ada, 8.9, and newer), AMD gfx950 and RDNA4 use the OCP formats (float8_e4m3fn,
float8_e5m2); AMD gfx942 (MI300) uses the "fnuz" variants (float8_e4m3fnuz: no negative
zero, one NaN, largest finite value 240 instead of 448). torch._scaled_mm takes the
dtype the device's FP8 units compute in: on ROCm it picks fnuz for gfx942 and OCP for the
rest (`_scaled_mm_is_fnuz` in aten/src/ATen/native/cuda/Blas.cpp).

Weights are quantized once at conversion; activations on every call with a scale from
their current absolute maximum (dynamic per-tensor scaling). torch._scaled_mm has no
backward, so these layers are for inference.

On CPU torch._scaled_mm runs (oneDNN) for the OCP dtypes; for the fnuz ones it raised
"itensor_view_from_dense expects ... fp8 tensor input" when this was written, so there the
same quantized operands are multiplied as float32 here (exactly the values an FP8 GEMM
multiplies, accumulated in float32), and the fnuz numerics are testable on any torch.
(torch 2.13.0's CPU build runs fnuz too: checked 2026-11-27, float32 output equal to the
float32 product.) A GPU never takes that path.

Lives in layer 1 of the core (it imports only errors) so that the kernel registry and the
passes above can both use it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchbridge.errors import ModelOptimizationError

logger = logging.getLogger(__name__)

# FP8 GEMMs (cuBLASLt, hipBLASLt) need the inner and output dimensions to be multiples of 16.
ALIGNMENT = 16
E4M3_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2,
              torch.float8_e5m2fnuz)
# oneDNN's _scaled_mm on CPU does not take these (see the module text).
_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def check_fp8_dtype(dtype: Any, error: type[Exception] = ModelOptimizationError
                    ) -> torch.dtype:
    if dtype not in FP8_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FP8_DTYPES)
        raise error(f"{dtype!r} is not an FP8 dtype; expected one of {names}")
    checked: torch.dtype = dtype
    return checked


def quantization_max(dtype: torch.dtype) -> float:
    """The value a tensor's absolute maximum is scaled onto: the dtype's largest finite value
    (448 for e4m3fn), except 224 rather than 240 for e4m3fnuz: vLLM found dynamic
    quantization to 240 loses accuracy on ROCm and uses 224 (get_fp8_min_max in
    vllm/model_executor/layers/quantization/utils/quant_utils.py)."""
    return 224.0 if dtype == torch.float8_e4m3fnuz else float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in `dtype`, dequantization scale): x ~= q.float() * scale. The scale maps the
    tensor's absolute maximum onto `quantization_max(dtype)`."""
    largest = quantization_max(dtype)
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = largest / amax
    q = (x.float() * scale).clamp(-largest, largest).to(dtype)
    return q, scale.reciprocal()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias in `out_dtype`, through torch._scaled_mm; on CPU
    with a fnuz dtype, the same product in float32 (see the module text)."""
    if a.device.type == "cpu" and a.dtype in _FNUZ:
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    result: torch.Tensor = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias,
                                            out_dtype=out_dtype)
    return result


class FP8Linear(nn.Module):
    """A drop-in for nn.Linear computing in FP8 (`fp8_dtype`, e4m3 by default). The matmul
    writes `out_dtype` (bf16); under autocast that is the output, otherwise the output is cast
    back to the input's dtype so the layers around it see what they saw before."""

    # Vendor plugins name their own error (the NVIDIA plugin's FP8CompilationError).
    error: type[Exception] = ModelOptimizationError

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 out_dtype: torch.dtype = torch.bfloat16, device: Any = None,
                 fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__()
        self.fp8_dtype = check_fp8_dtype(fp8_dtype, self.error)
        if in_features % ALIGNMENT or out_features % ALIGNMENT:
            raise self.error(
                f"FP8Linear needs dimensions divisible by {ALIGNMENT}, got in_features="
                f"{in_features}, out_features={out_features}")
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features,
                                                       dtype=fp8_dtype, device=device))
        self.register_buffer("weight_scale", torch.ones((), device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device)
                             if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_dtype: torch.dtype = torch.bfloat16,
                    fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> FP8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    out_dtype, device=linear.weight.device, fp8_dtype=fp8_dtype)
        with torch.no_grad():
            q, scale = quantize_fp8(linear.weight, fp8_dtype)
            layer.weight_fp8.copy_(q)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias.to(out_dtype))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, x_scale = quantize_fp8(x.reshape(-1, self.in_features), self.fp8_dtype)
        out = scaled_mm(xq, self.weight_fp8.t(), x_scale, self.weight_scale, self.bias,
                        self.out_dtype)
        out = out.reshape(*lead, self.out_features)
        if not torch.is_autocast_enabled(x.device.type) and out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out

    def extra_repr(self) -> str:
        fp8 = str(self.fp8_dtype).removeprefix("torch.float8_")
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, {fp8} -> {self.out_dtype}"


@dataclass
class FP8CompilationResult:
    """What an FP8 conversion did: the converted layers, the ones left alone and why, and the
    share of linear-layer weights now in FP8."""

    model: nn.Module
    fp8_layers: list[str] = field(default_factory=list)
    skipped_layers: dict[str, str] = field(default_factory=dict)
    coverage: float = 0.0
    implementation: str = "torch._scaled_mm"
    fp8_dtype: str = "float8_e4m3fn"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def convert_linears_to_fp8(model: nn.Module, fp8_dtype: torch.dtype = torch.float8_e4m3fn,
                           make_layer: Callable[[nn.Linear], nn.Module] | None = None,
                           implementation: str = "torch._scaled_mm",
                           error: type[Exception] = ModelOptimizationError
                           ) -> FP8CompilationResult:
    """Swap every nn.Linear whose dimensions are divisible by 16 for an FP8 layer, in place
    (`make_layer(linear)`, by default FP8Linear in `fp8_dtype`), and report coverage."""
    if not isinstance(model, nn.Module):
        raise error(f"expected an nn.Module, got {type(model).__name__}")
    check_fp8_dtype(fp8_dtype, error)
    factory = make_layer or (lambda linear: FP8Linear.from_linear(linear, fp8_dtype=fp8_dtype))
    result = FP8CompilationResult(model, implementation=implementation,
                                  fp8_dtype=str(fp8_dtype).removeprefix("torch."))
    total = converted = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        total += module.weight.numel()
        if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
            result.skipped_layers[name] = (
                f"{module.in_features}x{module.out_features} is not divisible by {ALIGNMENT}")
            continue
        _replace(model, name, factory(module))
        result.fp8_layers.append(name)
        converted += module.weight.numel()
    result.coverage = converted / total if total else 0.0
    logger.info("FP8 (%s): %d linear layers converted (%.0f%% of linear weights), %d skipped",
                result.fp8_dtype, len(result.fp8_layers), result.coverage * 100,
                len(result.skipped_layers))
    return result


def fp8_stats(model: nn.Module) -> dict[str, Any]:
    """{"fp8_layers", "linear_layers", "fp8_coverage"}: coverage by weight count."""
    fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
    linear = [m for m in model.modules() if type(m) is nn.Linear]
    fp8_weights = sum(m.in_features * m.out_features for m in fp8)
    all_weights = fp8_weights + sum(m.weight.numel() for m in linear)
    return {"fp8_layers": len(fp8), "linear_layers": len(fp8) + len(linear),
            "fp8_coverage": fp8_weights / all_weights if all_weights else 0.0}
