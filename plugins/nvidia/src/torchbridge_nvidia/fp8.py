"""Real FP8 inference: e4m3 weights and activations with per-tensor scales, matmul in
torch._scaled_mm (FP8 tensor cores on Hopper and newer; it also runs on CPU, which is how the
numerics are tested here). Transformer Engine is used instead when it is installed and the
model is on a GPU.

Weights are quantized once at conversion; activations are quantized on every call with a
scale from their current absolute maximum (dynamic per-tensor scaling). torch._scaled_mm has
no backward, so these layers are for inference; FP8 training needs Transformer Engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchbridge_nvidia.errors import FP8CompilationError

logger = logging.getLogger(__name__)
E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# FP8 tensor-core GEMMs need the inner and output dimensions to be multiples of 16.
ALIGNMENT = 16


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, dequantization scale): x ~= q.float() * scale. The scale maps the
    tensor's absolute maximum onto e4m3's largest finite value."""
    amax = x.detach().abs().amax().float().clamp(min=1e-12)
    scale = E4M3_MAX / amax
    q = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, scale.reciprocal()


class FP8Linear(nn.Module):
    """A drop-in for nn.Linear computing in FP8. The matmul writes `out_dtype` (bf16); under
    autocast that is the output, otherwise the output is cast back to the input's dtype so
    the layers around it see what they saw before."""

    weight_fp8: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 out_dtype: torch.dtype = torch.bfloat16, device: Any = None) -> None:
        super().__init__()
        if in_features % ALIGNMENT or out_features % ALIGNMENT:
            raise FP8CompilationError(
                f"FP8Linear needs dimensions divisible by {ALIGNMENT}, got in_features="
                f"{in_features}, out_features={out_features}")
        self.in_features, self.out_features, self.out_dtype = in_features, out_features, out_dtype
        self.register_buffer("weight_fp8", torch.zeros(out_features, in_features, dtype=E4M3,
                                                       device=device))
        self.register_buffer("weight_scale", torch.ones((), device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=out_dtype, device=device)
                             if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, out_dtype: torch.dtype = torch.bfloat16
                    ) -> FP8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    out_dtype, device=linear.weight.device)
        with torch.no_grad():
            q, scale = quantize_e4m3(linear.weight)
            layer.weight_fp8.copy_(q)
            layer.weight_scale.copy_(scale)
            if linear.bias is not None and layer.bias is not None:
                layer.bias.copy_(linear.bias.to(out_dtype))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        xq, x_scale = quantize_e4m3(x.reshape(-1, self.in_features))
        out = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=x_scale,
                               scale_b=self.weight_scale, bias=self.bias,
                               out_dtype=self.out_dtype)
        out = out.reshape(*lead, self.out_features)
        if not torch.is_autocast_enabled(x.device.type) and out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}, e4m3 -> {self.out_dtype}"


@dataclass
class FP8CompilationResult:
    """What compile_with_fp8 did: the converted layers, the ones left alone and why, and the
    share of linear-layer weights now in FP8."""

    model: nn.Module
    fp8_layers: list[str] = field(default_factory=list)
    skipped_layers: dict[str, str] = field(default_factory=dict)
    coverage: float = 0.0
    implementation: str = "torch._scaled_mm"


def _transformer_engine() -> Any | None:
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


class _TransformerEngineFP8(nn.Module):
    """Runs a model whose linears are te.Linear inside te.fp8_autocast."""

    def __init__(self, module: nn.Module, te: Any) -> None:
        super().__init__()
        self.module = module
        self._te = te

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._te.fp8_autocast(enabled=True):
            return self.module(*args, **kwargs)


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


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


class FP8Compiler:
    """`FP8Compiler().compile_with_fp8(model)` swaps every eligible nn.Linear (dimensions
    divisible by 16) for an FP8 layer, in place, and reports coverage."""

    def __init__(self, config: Any = None, *, use_transformer_engine: bool | None = None
                 ) -> None:
        self.config = config
        self.use_transformer_engine = use_transformer_engine

    def compile_with_fp8(self, model: nn.Module, for_inference: bool = True
                         ) -> FP8CompilationResult:
        if not isinstance(model, nn.Module):
            raise FP8CompilationError(f"expected an nn.Module, got {type(model).__name__}")
        on_gpu = any(p.is_cuda for p in model.parameters())
        te = _transformer_engine() if self.use_transformer_engine is not False and on_gpu \
            else None
        if self.use_transformer_engine and te is None:
            raise FP8CompilationError("use_transformer_engine=True, but transformer_engine "
                                      "is not installed or the model is not on a GPU")
        if not for_inference and te is None:
            raise FP8CompilationError("FP8 training needs Transformer Engine "
                                      "(pip install transformer-engine); torch._scaled_mm "
                                      "has no backward")
        result = FP8CompilationResult(model, implementation="transformer_engine" if te
                                      else "torch._scaled_mm")
        total = converted = 0
        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear:
                continue
            total += module.weight.numel()
            if module.in_features % ALIGNMENT or module.out_features % ALIGNMENT:
                result.skipped_layers[name] = (
                    f"{module.in_features}x{module.out_features} is not divisible by "
                    f"{ALIGNMENT}")
                continue
            _replace(model, name, _te_linear(te, module) if te else FP8Linear.from_linear(module))
            result.fp8_layers.append(name)
            converted += module.weight.numel()
        result.coverage = converted / total if total else 0.0
        if te is not None and result.fp8_layers:
            result.model = _TransformerEngineFP8(model, te)
        logger.info("FP8: %d linear layers converted (%.0f%% of linear weights), %d skipped",
                    len(result.fp8_layers), result.coverage * 100, len(result.skipped_layers))
        return result

    @staticmethod
    def get_fp8_stats(model: nn.Module) -> dict[str, Any]:
        """{"fp8_layers", "linear_layers", "fp8_coverage"}: coverage by weight count."""
        fp8 = [m for m in model.modules() if isinstance(m, FP8Linear)]
        linear = [m for m in model.modules() if type(m) is nn.Linear]
        fp8_weights = sum(m.in_features * m.out_features for m in fp8)
        all_weights = fp8_weights + sum(m.weight.numel() for m in linear)
        return {"fp8_layers": len(fp8), "linear_layers": len(fp8) + len(linear),
                "fp8_coverage": fp8_weights / all_weights if all_weights else 0.0}
