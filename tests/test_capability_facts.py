"""Capability facts that were wrong once (issue 19, "Facts are sourced"), each against its
public source, and the vendor error classes raised where their situation arises. The
per-vendor tables are exercised device by device in test_nvidia/amd/intel/tpu.py."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
import torchbridge
from test_amd import FakeGPUs as FakeAMDGPUs
from test_intel import RECORDED as INTEL_RECORDED
from test_nvidia import FakeGPUs as FakeNVIDIAGPUs
from test_nvidia import gpu_flags  # noqa: F401  (a fixture, used by name)
from torch import nn

PLUGINS = Path(__file__).resolve().parent.parent / "plugins"


# -- NVIDIA: Ada has FP8 -------------------------------------------------------------------
def test_ada_has_fp8_tensor_cores() -> None:
    # Ada Lovelace whitepaper (FP8 Transformer Engine); torch's _scaled_mm_allowed_device
    # accepts major >= 9 or 8.9 (aten/src/ATen/native/cuda/ScaledBlas.cpp).
    from torchbridge_nvidia.architecture import (
        FP8_MIN_CAPABILITY,
        NVIDIAArchitecture,
        architecture_of,
        precision_policy,
    )

    assert FP8_MIN_CAPABILITY == (8, 9) and architecture_of(8, 9) is NVIDIAArchitecture.ADA
    assert precision_policy(NVIDIAArchitecture.ADA).fp8
    assert not precision_policy(NVIDIAArchitecture.AMPERE).fp8
    assert not precision_policy(NVIDIAArchitecture.UNKNOWN).fp8


@pytest.mark.parametrize("gpu", ["L4", "RTX 4090"])
def test_fp8_linear_applies_on_ada(monkeypatch: pytest.MonkeyPatch, gpu: str,
                                   gpu_flags: None) -> None:  # noqa: F811
    from torchbridge.backends.nvidia import FP8Linear

    FakeNVIDIAGPUs(monkeypatch, gpu)
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement", "compile"]})
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    result = torchbridge.get_backend("cuda", cfg).optimize(model, "O3")
    assert "fp8_linear" in result.optimizations_applied
    assert [type(m).__name__ for m in result.model] == ["FP8Linear", "GELU", "FP8Linear"]
    assert all(m.weight_fp8.dtype == torch.float8_e4m3fn for m in result.model.modules()
               if isinstance(m, FP8Linear))
    info = torchbridge.get_backend("cuda").get_device_info()
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(info.supported_dtypes)


def test_fp8_compiler_refuses_a_gpu_older_than_ada(monkeypatch: pytest.MonkeyPatch) -> None:
    """InvalidComputeCapabilityError: the model is on a GPU whose capability is too old."""
    from torchbridge.backends.nvidia import FP8Compiler, InvalidComputeCapabilityError
    from torchbridge_nvidia import fp8

    assert fp8.gpu_capability(nn.Linear(4, 4)) is None  # on the CPU: nothing to check
    monkeypatch.setattr(fp8, "gpu_capability", lambda model: (8, 6))  # an A10 / RTX 3090
    with pytest.raises(InvalidComputeCapabilityError, match=r"8\.9, Ada.*this GPU is 8\.6"):
        FP8Compiler().compile_with_fp8(nn.Linear(64, 64))
    assert issubclass(InvalidComputeCapabilityError, torchbridge.DeviceError)
    monkeypatch.setattr(fp8, "gpu_capability", lambda model: (8, 9))  # an L4
    assert FP8Compiler().compile_with_fp8(nn.Sequential(nn.Linear(64, 64))).fp8_layers == ["0"]


def test_a_failing_flash_kernel_is_a_kernel_launch_error(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    from torchbridge.backends.nvidia import FlashAttention3, KernelLaunchError
    from torchbridge_nvidia import attention

    class BrokenFlash:
        error: type[Exception] = RuntimeError

        def flash_attn_func(self, *args: object, **kwargs: object) -> torch.Tensor:
            raise self.error("CUDA error: no kernel image is available for execution on "
                             "the device")

    broken = BrokenFlash()
    monkeypatch.setattr(attention, "_flash_attn_2", lambda: broken)
    attn = FlashAttention3(64, 4).eval()
    monkeypatch.setattr(attn, "select_path", lambda q, has_mask: ("flash_attn_2", "forced"))
    x = torch.randn(2, 8, 64)
    with pytest.raises(KernelLaunchError, match=r"flash_attn_2 failed.*no kernel image"):
        attn(x)
    assert issubclass(KernelLaunchError, torchbridge.KernelLaunchError)
    broken.error = torch.OutOfMemoryError  # memory stays memory, not a kernel failure
    with pytest.raises(torch.OutOfMemoryError):
        attn(x)


# -- AMD -----------------------------------------------------------------------------------
def test_mi100_bf16_and_gfx950_tf32_in_the_policy() -> None:
    from torchbridge.backends.amd import precision_policy

    mi100 = precision_policy("gfx908")  # AMD "AMD matrix cores" lab notes: MI100 BF16
    assert mi100.bf16 and mi100.preferred_low_precision_dtype == "bfloat16"
    assert not precision_policy("gfx1030").bf16  # RDNA2: no matrix instructions
    gfx950, gfx942 = precision_policy("gfx950"), precision_policy("gfx942")
    assert gfx950.tf32 and gfx950.tf32_emulated  # hipBLASLt PR 1806: bf16 emulation
    assert gfx942.tf32 and not gfx942.tf32_emulated  # CDNA 3 ISA: XF32 MFMAs
    assert "emulated" in gfx950.tf32_description and "matrix cores" not in \
        gfx950.tf32_description


def test_a_missing_rocm_device_index_is_a_rocm_device_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.amd import AMDBackend, ROCmDeviceError

    FakeAMDGPUs(monkeypatch, "MI300X", count=2)
    backend = AMDBackend()
    for call in (backend.preflight, backend.telemetry, backend.get_device_info):
        with pytest.raises(ROCmDeviceError, match=r"2 device\(s\); index 5 does not exist"):
            call(5)
    assert issubclass(ROCmDeviceError, torchbridge.DeviceError)
    assert backend.preflight(1).architecture == "gfx942"


# -- Intel: no TF32 on Alchemist ----------------------------------------------------------
def test_arc_a770_has_no_tf32_even_where_torch_does_not_report_the_flag() -> None:
    from torchbridge_intel.families import TF32_XMX, IntelFamily, identify
    from torchbridge_intel.policy import precision_policy

    a770 = INTEL_RECORDED["Arc A770"]
    # torch.xpu.is_tf32_supported() is has_subgroup_matrix_multiply_accumulate: True here.
    assert not precision_policy(a770, tf32=True).tf32  # the device's TF32 flag is False
    older_torch = dataclasses.replace(
        a770, has_subgroup_matrix_multiply_accumulate_tensor_float32=None)
    family = identify(older_torch).family
    assert family is IntelFamily.ALCHEMIST and TF32_XMX[family] is False
    assert not precision_policy(older_torch, True, TF32_XMX[family]).tf32
    b580 = INTEL_RECORDED["Arc B580"]  # Xe2: TF32 in its XMX, flag not reported
    assert precision_policy(b580, True, TF32_XMX[identify(b580).family]).tf32
    assert precision_policy(older_torch, True, None).tf32  # no knowledge: torch's verdict
    assert not precision_policy(INTEL_RECORDED["Max 1550"], tf32=None).tf32  # torch: no
    assert set(TF32_XMX) == set(IntelFamily) - {IntelFamily.UNKNOWN}


# -- every vendor error class is raised (or is a base others are raised as) -----------------
VENDOR_ERRORS = ["torchbridge_nvidia.errors", "torchbridge_amd.errors",
                 "torchbridge_intel.errors"]


def _raise_sites(module_name: str) -> str:
    package = Path(importlib.import_module(module_name).__file__ or "").parent
    return "\n".join(path.read_text() for path in sorted(package.glob("*.py"))
                     if path.name not in ("errors.py", "__init__.py"))


@pytest.mark.parametrize("module_name", VENDOR_ERRORS)
def test_every_vendor_error_class_is_raised_or_a_base(module_name: str) -> None:
    module = importlib.import_module(module_name)
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if c.__module__ == module_name]
    source = _raise_sites(module_name)
    unraised = []
    for cls in classes:
        if any(other is not cls and issubclass(other, cls) for other in classes):
            continue  # a base: raised as its subclasses, caught by `except` clauses
        used = rf"raise {cls.__name__}\(|\b(error|oom_error)\s*=\s*{cls.__name__}\b|" \
               rf"named_backend_class\([^)]*{cls.__name__}\)"  # raised by the core for it
        if not re.search(used, source):
            unraised.append(cls.__name__)
    assert unraised == []
