"""The core's FP8 linear as the vendor plugins' implementation of the `linear` op: chosen
by compute capability (NVIDIA) or architecture with its FP8 dtype (AMD), numerics checked
on this CPU."""

from __future__ import annotations

import pytest
import test_amd
import test_nvidia
import torch
import torchbridge
from torchbridge.kernels import ops
from torchbridge.kernels.choice import choose
from torchbridge.kernels.fp8_linear import fp8_linear_implementation


def _fp8_verdicts(backend_name: str) -> dict[str, str | None]:
    choice = choose("linear", torchbridge.get_backend(backend_name), dtype=torch.bfloat16)
    return {c.implementation.name: c.reason for c in choice.candidates
            if "fp8_linear" in c.implementation.name}


@pytest.mark.parametrize(("gpu", "eligible"), [("H100", True), ("A100", False)])
def test_nvidia_fp8_linear_from_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch,
                                                      gpu: str, eligible: bool) -> None:
    test_nvidia.FakeGPUs(monkeypatch, gpu)
    verdict = _fp8_verdicts("cuda")["cuda_fp8_linear_e4m3"]
    assert (verdict is None) == eligible
    if not eligible:
        assert verdict == "needs compute capability 8.9; the device has 8.0"


@pytest.mark.parametrize(("gpu", "chosen"), [("MI300X", "rocm_fp8_linear_e4m3fnuz"),
                                             ("MI355X", "rocm_fp8_linear_e4m3"), ("MI210", None)])
def test_amd_fp8_linear_in_the_architectures_dtype(monkeypatch: pytest.MonkeyPatch, gpu: str,
                                                   chosen: str | None) -> None:
    test_amd.FakeGPUs(monkeypatch, gpu)
    eligible = [name for name, reason in _fp8_verdicts("rocm").items() if reason is None]
    assert eligible == ([chosen] if chosen else [])


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_fp8_linear_numbers_on_cpu(fp8_dtype: torch.dtype) -> None:
    impl = fp8_linear_implementation("fp8", fp8_dtype)
    torch.manual_seed(0)
    x = torch.randn(4, 8, 128, dtype=torch.bfloat16)
    weight, bias = torch.randn(64, 128, dtype=torch.bfloat16), torch.randn(64)
    out = impl.forward(x, weight, bias)
    ref = ops.linear(x.float(), weight.float(), bias)
    assert out.shape == (4, 8, 64) and out.dtype == torch.bfloat16
    error = (out.float() - ref).norm() / ref.norm()
    assert error < 0.08  # e4m3: 3 mantissa bits, per-tensor scales
    assert impl.declines(x[..., :100], weight[:, :100], None) == \
        "FP8 GEMMs need dimensions divisible by 16, got 100 -> 64"
