"""The Intel plugin's prepare_model passes, on top of the core's (placement, conv-BN folding,
channels_last, autocast to the DeviceInfo's preferred dtype, torch.compile with inductor,
which targets XPU through Triton).

| pass | level | when |
| --- | --- | --- |
| fp64_check | O0 | a float64 model (parameters, buffers, sample input) on a device   |
|            |    | without fp64: fails here with the reason, before placement        |
| tf32 | O2 | torch reports TF32 support and hardware.intel.allow_tf32 |
| ipex_optimize | O2 | inference, IPEX matching this torch installed, use_ipex auto/true |
| compile (veto) | O2 | no Triton with the Intel backend: inductor could not build the kernels |

The device's capabilities come from ctx.device_info (policy.py filled it in), so these
checks read the same facts a compatibility check does: "float64" missing from
`supported_dtypes` and `extra["fp64"] is False` mean the device has no fp64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass, PassContext

from torchbridge_intel import probe
from torchbridge_intel.errors import IPEXUnavailableError, UnsupportedDtypeError
from torchbridge_intel.policy import fp64_refusal

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def float64_tensors(model: nn.Module, sample_input: Any = None) -> list[str]:
    """Names of the float64 parameters, buffers and sample-input tensors."""
    found = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
             if t.dtype == torch.float64]
    leaves = pytree.tree_leaves(sample_input)
    found += [f"sample_input[{i}]" for i, leaf in enumerate(leaves)
              if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.float64]
    return found


def _fp64_check(model: nn.Module, ctx: PassContext) -> str | None:
    if ctx.device_info.extra.get("fp64") is not False:
        return f"{ctx.device_info.name} computes in float64 (or does not say it cannot)"
    if not float64_tensors(model, ctx.sample_input):
        return "no float64 parameters, buffers or sample input"
    return None


def _refuse_fp64(model: nn.Module, ctx: PassContext) -> nn.Module:
    names = float64_tensors(model, ctx.sample_input)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    raise UnsupportedDtypeError(f"float64 tensors ({shown}): {fp64_refusal(ctx.device_info.name)}")


def _tf32_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.backend.hardware_config.allow_tf32:
        return "config hardware.intel.allow_tf32 is off"
    if not ctx.device_info.extra.get("tf32"):
        return f"torch reports no TF32 support on {ctx.device_info.name}"
    return None


def _tf32(model: nn.Module, ctx: PassContext) -> nn.Module:
    probe.enable_tf32()
    ctx.notes.append("tf32: float32 matmuls and convolutions on XPU may use TF32 "
                     "(torch.backends.mkldnn.allow_tf32, process-wide: oneDNN on the CPU "
                     "reads it too)")
    return model


def ipex_skip_reason(setting: bool | str, strict: bool) -> str | None:
    if setting is False:
        return "config hardware.intel.use_ipex is off"
    status = probe.ipex_status()
    if status.usable:
        return None
    if setting is True:
        if strict:
            raise IPEXUnavailableError(f"hardware.intel.use_ipex=True, but {status.reason}",
                                       field="hardware.intel.use_ipex", value=True)
        return f"config hardware.intel.use_ipex=True, but {status.reason}"
    return status.reason


def _ipex_check(model: nn.Module, ctx: PassContext) -> str | None:
    return ipex_skip_reason(ctx.backend.hardware_config.use_ipex, ctx.config.strict)


def _ipex(model: nn.Module, ctx: PassContext) -> nn.Module:
    import intel_extension_for_pytorch as ipex  # checked by ipex_status: matches this torch

    dtype = ctx.backend.low_precision_dtype(ctx.device_info) or torch.float32
    optimized: nn.Module = ipex.optimize(model.eval(), dtype=dtype)
    ctx.notes.append(f"ipex_optimize: ipex.optimize(dtype={dtype}) from "
                     f"intel-extension-for-pytorch {probe.ipex_status().version}")
    return optimized


def intel_passes(backend: Backend) -> list[OptimizationPass]:
    o0, o2 = OptimizationLevel.O0, OptimizationLevel.O2
    passes: list[Any] = [
        OptimizationPass("fp64_check", "refuses float64 models on devices without fp64",
                         o0, _refuse_fp64, _fp64_check, order=-10, mutates=False),
        OptimizationPass("tf32", "TF32 for float32 matmuls and convolutions on XPU", o2,
                         _tf32, _tf32_check, order=35, mutates=False),
        OptimizationPass("ipex_optimize", "intel-extension-for-pytorch's ipex.optimize "
                         "(weight prepacking, fusions)", o2, _ipex, _ipex_check,
                         mode="inference", order=55),
    ]
    triton_ok, why = probe.triton_xpu_status()
    if not triton_ok:
        passes.append(OptimizationPass.veto("compile", why))
    return passes
