"""The AMD plugin's prepare_model passes, on top of the core's (placement, conv-BN folding,
channels_last, autocast to the DeviceInfo's preferred dtype, torch.compile with inductor,
which generates Triton code for ROCm as for CUDA).

| pass | level | when |
| --- | --- | --- |
| rocm_blas_library | O1 | hardware.amd.preferred_blas; auto: hipBLASLt where torch supports it |
| tf32 | O2 | torch reports TF32 on the arch (gfx94x, gfx95x) and hardware.amd.allow_tf32 |
| rocm_flash_attention | O2 | hardware.amd.flash_attention_library is aotriton or ck, and the arch |
|  |  | has it |
| fp8_linear | O3 | inference, an FP8 arch for this torch's ROCm (gfx942 fnuz; gfx950, gfx12 |
|  |  | OCP: architecture.FP8_MIN_ROCM), fp8_enabled |

Architecture lists, from torch's sources (ROCm >= 6.5 assumed; older ROCm has fewer):
hipBLASLt: aten/src/ATen/Context.cpp (`blasPreferredBackend`: outside this list torch warns
"Attempting to use hipBLASLt on an unsupported architecture!" and falls back to hipBLAS);
CK flash attention: Context.cpp `setROCmFAPreferredBackend` (gfx90a, gfx942); CK GEMM:
torch/_inductor/config.py `ck_supported_arch`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass, PassContext
from torchbridge.optimize.settings import (
    BLAS_LIBRARY,
    ROCM_FLASH_LIBRARY,
    TF32_MATMUL,
    environment_setting,
)

from torchbridge_amd import probe
from torchbridge_amd.architecture import AMDFamily, PrecisionPolicy, family_of, precision_policy
from torchbridge_amd.errors import FP8CompilationError, InvalidArchitectureError

if TYPE_CHECKING:
    from torchbridge.backend import Backend

HIPBLASLT_ARCHS = ("gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1200", "gfx1201")
CK_GEMM_ARCHS = ("gfx90a", "gfx942", "gfx950")
CK_FLASH_ARCHS = ("gfx90a", "gfx942")


def effective_architecture(ctx: PassContext) -> str:
    """The device's gfx name; config.hardware.amd.architecture only fills in for a GPU the
    table does not know. A setting contradicting a known GPU is an InvalidArchitectureError
    in strict mode and otherwise noted and ignored."""
    detected = ctx.device_info.compute_capability or "unknown"
    configured = ctx.backend.hardware_config.architecture
    if configured in ("auto", detected):
        return detected
    if family_of(detected) is AMDFamily.UNKNOWN:
        return str(configured)
    message = (f"hardware.amd.architecture={configured} but {ctx.device_info.name} is "
               f"{detected}")
    if ctx.config.strict:
        raise InvalidArchitectureError(message, field="hardware.amd.architecture",
                                       value=configured)
    note = f"{message}; using {detected}"
    if note not in ctx.notes:
        ctx.notes.append(note)
    return detected


def _policy(ctx: PassContext) -> PrecisionPolicy:
    # torch's FP8 gate depends on the ROCm torch was built with as well as the architecture.
    return precision_policy(effective_architecture(ctx), probe.hip_version())


def _refuse(ctx: PassContext, field: str, value: Any, why: str) -> str:
    """A setting the architecture cannot honour: an error in strict mode, else the reason
    the pass is skipped."""
    message = f"config hardware.amd.{field}={value!r}, but {why}"
    if ctx.config.strict:
        raise InvalidArchitectureError(message, field=f"hardware.amd.{field}", value=value)
    return message


# -- BLAS library --------------------------------------------------------------------------
def _blas_choice(ctx: PassContext) -> tuple[str | None, str | None]:
    """(library to set, None) or (None, reason to skip)."""
    if not hasattr(torch.backends.cuda, "preferred_blas_library"):
        return None, f"torch {torch.__version__} has no preferred_blas_library"
    setting = ctx.backend.hardware_config.preferred_blas
    arch = effective_architecture(ctx)
    if setting == "hipblas":
        return "hipblas", None
    supported = {"hipblaslt": HIPBLASLT_ARCHS, "ck": CK_GEMM_ARCHS}
    wanted = "hipblaslt" if setting == "auto" else setting
    if arch in supported[wanted]:
        return wanted, None
    why = f"torch supports {wanted} on {', '.join(supported[wanted])}, not {arch}"
    if setting == "auto":
        return None, f"{why}; hipBLAS (torch's default there) stays"
    return None, _refuse(ctx, "preferred_blas", setting, why)


def _blas_check(model: nn.Module, ctx: PassContext) -> str | None:
    return _blas_choice(ctx)[1]


def _blas(model: nn.Module, ctx: PassContext) -> nn.Module:
    library, _ = _blas_choice(ctx)
    assert library is not None
    torch.backends.cuda.preferred_blas_library(library)
    ctx.notes.append(f"rocm_blas_library: torch.backends.cuda.preferred_blas_library("
                     f"{library!r}), around the prepared model's calls only")
    return model


def _library_name(value: object) -> str:
    """torch's enum (_BlasBackend.Cublaslt, _ROCmFABackend.Ck) as the name a user passes."""
    name = str(getattr(value, "name", value)).lower()
    return {"cublaslt": "hipblaslt", "cublas": "hipblas"}.get(name, name)


def _blas_in_force(model: nn.Module, ctx: PassContext) -> str | None:
    library, reason = _blas_choice(ctx)
    if library is None:
        return reason
    now = _library_name(torch.backends.cuda.preferred_blas_library())
    return None if now == library else f"torch's preferred BLAS library is {now}"


# -- TF32 ----------------------------------------------------------------------------------
def _tf32_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not ctx.backend.hardware_config.allow_tf32:
        return "config hardware.amd.allow_tf32 is off"
    policy = _policy(ctx)
    if not policy.tf32:
        return (f"{policy.architecture} has no TF32 (torch reports it on gfx94x and gfx95x "
                "only)")
    return None


def _tf32(model: nn.Module, ctx: PassContext) -> nn.Module:
    torch.backends.cuda.matmul.allow_tf32 = True
    # On ROCm torch also asks the environment: TF32 in hipBLASLt is "behind a flag because
    # the TF32 support is new and only for MI300+" (torch's test_linalg sets it the same way
    # at run time; Context.cpp reads HIPBLASLT_ALLOW_TF32).
    os.environ.setdefault("HIPBLASLT_ALLOW_TF32", "1")
    ctx.notes.append(f"tf32: {_policy(ctx).tf32_description} (allow_tf32 around the "
                     "prepared model's calls; HIPBLASLT_ALLOW_TF32="
                     f"{os.environ['HIPBLASLT_ALLOW_TF32']} in the environment)")
    return model


# torch reads it in ATen's Context (allowTF32CuBLAS on ROCm), not per model: an environment
# variable cannot be scoped to one model's calls.
HIPBLASLT_TF32 = environment_setting(
    "HIPBLASLT_ALLOW_TF32", "an environment variable torch's ROCm build reads for every "
    "float32 matmul of the process")


def _tf32_on(model: nn.Module, ctx: PassContext) -> str | None:
    reason = _tf32_check(model, ctx)
    if reason is not None:
        return reason
    if not torch.backends.cuda.matmul.allow_tf32:
        return "torch did not take allow_tf32"
    return None


# -- flash attention library ---------------------------------------------------------------
def _flash_check(model: nn.Module, ctx: PassContext) -> str | None:
    if not hasattr(torch.backends.cuda, "preferred_rocm_fa_library"):
        return f"torch {torch.__version__} has no preferred_rocm_fa_library"
    setting = ctx.backend.hardware_config.flash_attention_library
    preflight = ctx.device_info.extra.get("preflight", {})
    status = preflight.get("flash_attention", "unsupported")
    arch = effective_architecture(ctx)
    if status == "not built":
        return "this torch build has no flash attention (AOTriton)"
    if setting == "auto":
        return (f"auto keeps torch's default library (AOTriton); flash attention on {arch}: "
                f"{status}")
    if setting == "ck" and arch not in CK_FLASH_ARCHS:
        return _refuse(ctx, "flash_attention_library", setting,
                       f"torch allows CK flash attention on {', '.join(CK_FLASH_ARCHS)} only, "
                       f"not {arch}")
    if setting == "aotriton" and status in ("unsupported", "experimental"):
        return _refuse(ctx, "flash_attention_library", setting,
                       f"AOTriton's flash attention on {arch} is {status}"
                       + (" (TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 enables it)"
                          if status == "experimental" else ""))
    return None


def _flash(model: nn.Module, ctx: PassContext) -> nn.Module:
    library = ctx.backend.hardware_config.flash_attention_library
    torch.backends.cuda.preferred_rocm_fa_library(library)
    ctx.notes.append(f"rocm_flash_attention: torch.backends.cuda.preferred_rocm_fa_library("
                     f"{library!r}), around the prepared model's calls only")
    return model


def _flash_in_force(model: nn.Module, ctx: PassContext) -> str | None:
    wanted = ctx.backend.hardware_config.flash_attention_library
    now = _library_name(torch.backends.cuda.preferred_rocm_fa_library())
    return None if now == wanted else f"torch's flash-attention library is {now}"


# -- FP8 -----------------------------------------------------------------------------------
def fp8_skip_reason(policy: PrecisionPolicy, setting: bool | str, ctx: PassContext
                    ) -> str | None:
    if setting is False:
        return "config hardware.amd.fp8_enabled is off"
    why = policy.fp8_refusal
    if why is None:
        return None
    if setting is True:
        return _refuse(ctx, "fp8_enabled", True, why)
    return why


def _fp8_check(model: nn.Module, ctx: PassContext) -> str | None:
    if ctx.quantize is not None:  # the quantize pass (torchao) takes the Linear layers
        return f"quantize={ctx.quantize!r} asked for: torchao quantizes the Linear layers"
    reason = fp8_skip_reason(_policy(ctx), ctx.backend.hardware_config.fp8_enabled, ctx)
    if reason is None and not any(type(m) is nn.Linear for m in model.modules()):
        return "no nn.Linear in the model"
    return reason


def _fp8(model: nn.Module, ctx: PassContext) -> nn.Module:
    from torchbridge.fp8 import convert_linears_to_fp8

    dtype = _policy(ctx).fp8_dtype
    assert dtype is not None
    result = convert_linears_to_fp8(model, dtype, error=FP8CompilationError)
    ctx.notes.append(f"fp8_linear: {len(result.fp8_layers)} linear layers in "
                     f"{result.fp8_dtype} via torch._scaled_mm ({result.coverage:.0%} of "
                     "linear weights)" + (f"; left in place: {result.skipped_layers}"
                                          if result.skipped_layers else ""))
    return result.model


def amd_passes(backend: Backend) -> list[OptimizationPass]:
    o1, o2, o3 = OptimizationLevel.O1, OptimizationLevel.O2, OptimizationLevel.O3
    passes: list[Any] = [
        OptimizationPass("rocm_blas_library", "preferred BLAS library (hipBLASLt where "
                         "supported)", o1, _blas, _blas_check, order=30,
                         mutates=False, settings=(BLAS_LIBRARY,), effect=_blas_in_force),
        OptimizationPass("tf32", "TF32 for float32 matmuls (native XF32 or hipBLASLt's "
                         "emulation, as the architecture has it)", o2, _tf32,
                         _tf32_check, order=35, mutates=False,
                         settings=(TF32_MATMUL, HIPBLASLT_TF32), effect=_tf32_on),
        OptimizationPass("rocm_flash_attention", "SDPA flash-attention library (AOTriton or "
                         "CK)", o2, _flash, _flash_check, order=36, mutates=False,
                         settings=(ROCM_FLASH_LIBRARY,), effect=_flash_in_force),
        OptimizationPass("fp8_linear", "nn.Linear layers swapped for FP8 layers in the "
                         "architecture's FP8 dtype", o3, _fp8, _fp8_check, mode="inference",
                         order=55),
    ]
    return passes
