"""The NVIDIA plugin's prepare_model passes, on top of the core's (placement, conv-BN
folding, channels_last, autocast to the DeviceInfo's preferred dtype, torch.compile).

| pass | level | when |
| --- | --- | --- |
| cudnn_benchmark | O1 | the model has convolutions and hardware.nvidia.cudnn_benchmark |
| tf32 | O2 | Ampere or newer and hardware.nvidia.allow_tf32 |
| max_autotune | O3 | inference: inductor max-autotune and CUDA graphs |
| fp8_linear | O3 | inference, Ada (8.9) or newer, hardware.nvidia.fp8_enabled auto or on |

tf32 sits at O2 although the issue of precision is small: TF32 keeps 10 mantissa bits, so
O1's promise (float32 agreement) would not hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.core_passes import compile_ahead, compiled_with
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.settings import CUDNN_BENCHMARK, CUDNN_TF32, TF32_MATMUL

from torchbridge_nvidia.architecture import (
    NVIDIAArchitecture,
    PrecisionPolicy,
    at_least,
    not_in_table,
    precision_policy,
)
from torchbridge_nvidia.errors import InvalidArchitectureError

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def effective_architecture(ctx: PassContext) -> NVIDIAArchitecture:
    """The device's architecture; config.hardware.nvidia.architecture only fills in for a
    GPU the table does not know (the plugin's DeviceInfo has it filled in already, see
    devices.configured_architecture). A setting contradicting a known GPU is a
    ConfigurationError in strict mode and otherwise noted and ignored."""
    detected = NVIDIAArchitecture(ctx.device_info.architecture or "unknown")
    configured = ctx.backend.hardware_config.architecture
    if configured == "auto" or configured == detected:
        return detected
    configured = NVIDIAArchitecture(configured)
    if detected is NVIDIAArchitecture.UNKNOWN:
        return configured
    message = (f"hardware.nvidia.architecture={configured.value} but "
               f"{ctx.device_info.name} is {detected.value}")
    if ctx.config.strict:
        raise InvalidArchitectureError(message, field="hardware.nvidia.architecture",
                                       value=configured.value)
    note = f"{message}; using {detected.value}"
    if note not in ctx.notes:
        ctx.notes.append(note)
    return detected


def _policy(ctx: PassContext) -> PrecisionPolicy:
    return precision_policy(effective_architecture(ctx))


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def _cudnn_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.backend.hardware_config.cudnn_benchmark:
        return "config hardware.nvidia.cudnn_benchmark is off"
    return None if _has_conv(model) else "no convolution in the model"


def _cudnn_benchmark(model: nn.Module, ctx: PassContext) -> nn.Module:
    torch.backends.cudnn.benchmark = True
    ctx.notes.append("cudnn_benchmark: pays off when input shapes stay fixed (each new shape "
                     "is re-tuned); set around the prepared model's calls only")
    return model


def _cudnn_benchmark_on(model: nn.Module, ctx: PassContext) -> str | None:
    return None if torch.backends.cudnn.benchmark else \
        "torch.backends.cudnn.benchmark is not set"


def _tf32_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.backend.hardware_config.allow_tf32:
        return "config hardware.nvidia.allow_tf32 is off"
    arch = effective_architecture(ctx)
    if arch is NVIDIAArchitecture.UNKNOWN:  # not known to lack them: not known at all
        return f"{not_in_table(ctx.device_info.compute_capability)}; no TF32 assumed (set " \
               "hardware.nvidia.architecture if you know it)"
    if not at_least(arch, NVIDIAArchitecture.AMPERE):
        return f"{arch.value} has no TF32 tensor cores (Ampere and newer do)"
    return None


def _tf32(model: nn.Module, ctx: PassContext) -> nn.Module:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    ctx.notes.append("tf32: float32 matmuls and convolutions use TF32 tensor cores (set "
                     "around the prepared model's calls only)")
    return model


def _tf32_on(model: nn.Module, ctx: PassContext) -> str | None:
    if _tf32_check(model, ctx) is not None:
        return _tf32_check(model, ctx)
    if not (torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32):
        return "torch did not take allow_tf32"
    return None


def _max_autotune(model: nn.Module, ctx: PassContext) -> nn.Module:
    # Inference only: CUDA graphs replay fixed memory addresses, which training's changing
    # parameters and optimizer state would break.
    ctx.state.setdefault("compile_options", {}).update(
        {"max_autotune": True, "triton.cudagraphs": True})
    return model


def _max_autotune_check(model: nn.Module, ctx: PassContext) -> str | None:
    return compile_ahead(ctx)  # options of the compile pass: nothing without it


def fp8_skip_reason(policy: PrecisionPolicy, setting: bool | str, strict: bool,
                    capability: str | None = None) -> str | None:
    """`capability`: the device's ("13.0"), named when the table does not know it."""
    if setting is False:
        return "config hardware.nvidia.fp8_enabled is off"
    if policy.fp8:
        return None
    if policy.architecture is NVIDIAArchitecture.UNKNOWN:
        # A fact about this plugin's table, not about the GPU (a newer one may well have
        # FP8): say which, and how to tell the plugin.
        why = f"{not_in_table(capability)}; no FP8 assumed (set " \
              "hardware.nvidia.architecture if you know it)"
    else:
        why = f"{policy.architecture.value} has no FP8 tensor cores (Ada, compute " \
              "capability 8.9, and newer do)"
    if setting is True:
        if strict:
            raise InvalidArchitectureError(f"hardware.nvidia.fp8_enabled=True, but {why}",
                                           field="hardware.nvidia.fp8_enabled", value=True)
        return f"config hardware.nvidia.fp8_enabled=True, but {why}"
    return why


def _fp8_check(model: nn.Module, ctx: PassContext) -> str | None:
    if ctx.quantize is not None:  # the quantize pass (torchao) takes the Linear layers
        return f"quantize={ctx.quantize!r} asked for: torchao quantizes the Linear layers"
    reason = fp8_skip_reason(_policy(ctx), ctx.backend.hardware_config.fp8_enabled,
                             ctx.config.strict, ctx.device_info.compute_capability)
    if reason is None and not any(type(m) is nn.Linear for m in model.modules()):
        return "no nn.Linear in the model"
    return reason


def _fp8(model: nn.Module, ctx: PassContext) -> nn.Module:
    from torchbridge_nvidia.fp8 import FP8Compiler

    result = FP8Compiler().compile_with_fp8(model, for_inference=True)
    ctx.notes.append(f"fp8_linear: {len(result.fp8_layers)} linear layers in FP8 via "
                     f"{result.implementation} ({result.coverage:.0%} of linear weights)"
                     + (f"; left in place: {result.skipped_layers}"
                        if result.skipped_layers else ""))
    return result.model


def nvidia_passes(backend: Backend) -> list[OptimizationPass]:
    o1, o2, o3 = OptimizationLevel.O1, OptimizationLevel.O2, OptimizationLevel.O3
    passes: list[Any] = [
        OptimizationPass("cudnn_benchmark", "cuDNN autotunes convolution algorithms", o1,
                         _cudnn_benchmark, _cudnn_check, order=30, mutates=False,
                         settings=(CUDNN_BENCHMARK,), effect=_cudnn_benchmark_on),
        OptimizationPass("tf32", "TF32 tensor cores for float32 matmuls and convolutions",
                         o2, _tf32, _tf32_check, order=35, mutates=False,
                         settings=(TF32_MATMUL, CUDNN_TF32), effect=_tf32_on),
        OptimizationPass("fp8_linear", "nn.Linear layers swapped for FP8 (e4m3) layers",
                         o3, _fp8, _fp8_check, mode="inference", order=55),
        OptimizationPass("max_autotune", "inductor max-autotune and CUDA graphs", o3,
                         _max_autotune, _max_autotune_check, mode="inference", order=79,
                         mutates=False,
                         effect=compiled_with("max_autotune")),
    ]
    return passes
