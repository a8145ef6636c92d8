"""The Intel plugin's prepare_model passes, on top of the core's (placement, conv-BN folding,
channels_last, autocast to the DeviceInfo's preferred dtype, torch.compile with inductor,
which targets XPU through Triton).

| pass | level | when |
| --- | --- | --- |
| tf32 | O2 | torch reports TF32 support and hardware.intel.allow_tf32 |
| ipex_optimize | O2 | inference, IPEX matching this torch installed, use_ipex auto/true |
| compile (veto) | O2 | no Triton with the Intel backend: inductor could not build the kernels |

The device's capabilities come from ctx.device_info (policy.py filled it in), so these
checks read the same facts a compatibility check does. A float64 model on a device without
fp64 (`extra["fp64"] is False`) is refused by the core before placement, in every mode
(torchbridge.optimize.pipeline.refuse_float64): it could not run there at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.settings import ONEDNN_TF32, ProcessSetting

from torchbridge_intel import probe
from torchbridge_intel.errors import IPEXUnavailableError

if TYPE_CHECKING:
    from torchbridge.backend import Backend


def _tf32_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.backend.hardware_config.allow_tf32:
        return "config hardware.intel.allow_tf32 is off"
    if not ctx.device_info.extra.get("tf32"):
        return (f"{ctx.device_info.name} has no TF32 (DeviceInfo.extra['tf32'] is False: "
                "its XMX multiplies no TF32, or torch reports none)")
    return None


def _tf32(model: nn.Module, ctx: PassContext) -> nn.Module:
    probe.enable_tf32()
    ctx.notes.append("tf32: float32 matmuls and convolutions on XPU may use TF32 "
                     "(torch.backends.mkldnn.allow_tf32, set around the prepared model's "
                     "calls only: oneDNN on the CPU reads it too)")
    return model


# The oneDNN flag, read and set through the probe seam (tests replay a device there).
TF32_SETTING = ProcessSetting(ONEDNN_TF32.name, lambda: probe.tf32_enabled(),
                              lambda value: probe.set_tf32(value))


def _tf32_on(model: nn.Module, ctx: PassContext) -> str | None:
    reason = _tf32_check(model, ctx)
    if reason is not None:
        return reason
    if probe.tf32_enabled() is not True:
        # A torch built without XPU support ignores the setter (with a warning).
        return f"torch did not take torch.backends.mkldnn.allow_tf32 (it reads " \
               f"{probe.tf32_enabled()!r}): this torch has no Intel GPU support"
    return None


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
    o2 = OptimizationLevel.O2
    passes: list[Any] = [
        OptimizationPass("tf32", "TF32 for float32 matmuls and convolutions on XPU", o2,
                         _tf32, _tf32_check, order=35, mutates=False,
                         settings=(TF32_SETTING,), effect=_tf32_on),
        OptimizationPass("ipex_optimize", "intel-extension-for-pytorch's ipex.optimize "
                         "(weight prepacking, fusions)", o2, _ipex, _ipex_check,
                         mode="inference", order=55),
    ]
    triton_ok, why = probe.triton_xpu_status()
    if not triton_ok:
        passes.append(OptimizationPass.veto("compile", why))
    return passes
