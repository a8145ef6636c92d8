"""Passes the core offers on every backend. Backend plugins add, replace or veto them.

| pass | level | when |
| --- | --- | --- |
| device_placement | O0 | always |
| conv_bn_folding | O1 | eval mode, a Conv followed by BatchNorm, the model traces with torch.fx |
| channels_last | O1 | the model has Conv2d and the device runs NHWC convolutions natively |
| transformer_composite | O2 | eval mode, nn.TransformerEncoderLayer: off the fused fast path |
| autocast | O2 | the device has a native low-precision dtype (or config.precision names one) |
| low_precision_weights | O3 | eval mode, after autocast: Linear/Conv/MHA weights in its dtype |
| compile | O2 | torch.compile with inductor; options through ctx.state["compile_options"], |
|  |  | skipped when an earlier pass set ctx.state["skip_compile"] to its reason |
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass, PassContext

# Devices whose convolution libraries (oneDNN, cuDNN, MIOpen) have native NHWC kernels.
CHANNELS_LAST_DEVICES = {"cpu", "cuda", "xpu"}


def _place(model: nn.Module, ctx: PassContext) -> nn.Module:
    return model.to(ctx.backend.device)


def _has_conv_bn(model: nn.Module) -> bool:
    mods = list(model.modules())
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in mods) and \
        any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in mods)


def _conv_bn_check(model: nn.Module, ctx: PassContext) -> str | None:
    return None if _has_conv_bn(model) else "no convolution with BatchNorm in the model"


def _fold_conv_bn(model: nn.Module, ctx: PassContext) -> nn.Module:
    from torch.fx.experimental.optimization import fuse

    folded = fuse(model)  # traces with torch.fx; raises on untraceable models (rolled back)
    if _has_conv_bn(folded):
        ctx.notes.append("conv_bn_folding: some BatchNorm layers do not follow a conv and "
                         "were kept")
    return folded


def _channels_last_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        return "no Conv2d in the model"
    if ctx.backend.device.type not in CHANNELS_LAST_DEVICES:
        return f"{ctx.backend.device.type} has no native channels_last convolutions"
    return None


def _channels_last(model: nn.Module, ctx: PassContext) -> nn.Module:
    converted: nn.Module = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return converted


class AutocastModule(nn.Module):
    """Runs the wrapped module under torch.autocast and returns floating outputs in the
    dtype of the first floating input (float32 in, float32 out), so callers' losses and
    comparisons see the dtype they passed in."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type
        self.dtype = dtype
        # torch.compile keeps its graphs per code object and falls back to eager after
        # `recompile_limit` (8) variants. Every prepared model shares this class's forward,
        # so the ninth compiled model in a process would silently run uncompiled (seen in
        # the benchmark). A copy of the code object per instance gives each its own cache.
        forward = AutocastModule._forward
        self.forward = types.MethodType(types.FunctionType(
            forward.__code__.replace(), forward.__globals__, forward.__name__,
            forward.__defaults__, forward.__closure__), self)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        in_dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)
                         and a.is_floating_point()), torch.float32)
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            out = self.module(*args, **kwargs)
        return _cast_floating(out, in_dtype)


def _cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return tuple(_cast_floating(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [_cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: _cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def _autocast_check(model: nn.Module, ctx: PassContext) -> str | None:
    if ctx.backend.low_precision_dtype(ctx.device_info) is None:
        return (f"{ctx.device_info.name} has no native low-precision dtype "
                f"(and config.precision is {ctx.config.precision})")
    return None


def _autocast(model: nn.Module, ctx: PassContext) -> nn.Module:
    dtype = ctx.backend.low_precision_dtype(ctx.device_info)
    assert dtype is not None
    ctx.state["autocast_dtype"] = dtype
    if dtype == torch.float16 and ctx.training:
        # fp16's narrow range underflows small gradients; bf16 has float32's range.
        ctx.notes.append("autocast: training in float16 needs loss scaling; use "
                         f"torch.amp.GradScaler({ctx.backend.device.type!r})")
    return AutocastModule(model, ctx.backend.device.type, dtype)


# Weights autocast would cast on every call; stored in the low-precision dtype instead.
_LOW_PRECISION_WEIGHT_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.MultiheadAttention)


def _weights_check(model: nn.Module, ctx: PassContext) -> str | None:
    if "autocast_dtype" not in ctx.state:
        return "autocast did not run"
    if not any(isinstance(m, _LOW_PRECISION_WEIGHT_MODULES) for m in model.modules()):
        return "no Linear, Conv or MultiheadAttention in the model"
    return None


def _low_precision_weights(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Norms, embeddings and buffers stay float32: autocast runs norms in float32 anyway,
    # and an embedding's output would otherwise change dtype outside autocast's control.
    dtype = ctx.state["autocast_dtype"]
    for module in model.modules():
        if isinstance(module, _LOW_PRECISION_WEIGHT_MODULES):
            for name, param in module.named_parameters(recurse=False):
                if param.is_floating_point():
                    setattr(module, name, nn.Parameter(param.detach().to(dtype),
                                                       requires_grad=False))
    return model


def _compile_check(model: nn.Module, ctx: PassContext) -> str | None:
    # An earlier pass that measured the model may have found compiling not worth its cost.
    reason: str | None = ctx.state.get("skip_compile")
    return reason


def _compile(model: nn.Module, ctx: PassContext) -> nn.Module:
    options: dict[str, Any] = ctx.state.get("compile_options", {})
    backend: str = ctx.state.get("compile_backend", "inductor")
    compiled = torch.compile(model, backend=backend, options=options or None)
    ctx.notes.append(f"compile: torch.compile(backend={backend!r}, options={options}); "
                     "the first call compiles")
    return compiled  # type: ignore[return-value]


def core_passes() -> list[OptimizationPass]:
    from torchbridge.optimize.transformer import composite_check, use_composite_path

    o0, o1, o2 = OptimizationLevel.O0, OptimizationLevel.O1, OptimizationLevel.O2
    o3 = OptimizationLevel.O3
    return [
        OptimizationPass("device_placement", "moved parameters and buffers to the device",
                         o0, _place, order=0),
        OptimizationPass("conv_bn_folding", "folded BatchNorm into the preceding convolution",
                         o1, _fold_conv_bn, _conv_bn_check, mode="inference", order=10,
                         mutates=False),
        OptimizationPass("channels_last", "converted conv weights to channels_last (NHWC)",
                         o1, _channels_last, _channels_last_check, order=20),
        OptimizationPass("transformer_composite", "TransformerEncoderLayers run ordinary "
                         "ops instead of the fused fast path that ignores CPU autocast",
                         o2, use_composite_path, composite_check, mode="inference",
                         order=40),
        OptimizationPass("autocast", "computes in the device's low-precision dtype inside "
                         "the compiled region; outputs cast back to the input dtype",
                         o2, _autocast, _autocast_check, order=60, mutates=False),
        OptimizationPass("low_precision_weights", "Linear, Conv and attention weights "
                         "stored in the autocast dtype, not cast on every call", o3,
                         _low_precision_weights, _weights_check, mode="inference",
                         order=62),
        OptimizationPass("compile", "torch.compile with inductor", o2, _compile,
                         _compile_check, order=80, mutates=False),
    ]
