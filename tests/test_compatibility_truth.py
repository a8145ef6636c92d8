"""check_compatibility against present devices says what their own descriptions say: FP8
where the device lists the model's float8 dtype (not only on NVIDIA), and float64 refused
exactly where prepare_model refuses it. Recorded devices at each plugin's probe seam, as in
test_nvidia/amd/intel.py."""

from __future__ import annotations

import pytest
import torch
import torchbridge
from test_amd import FakeGPUs as FakeAMDGPUs
from test_intel import FakeXPUs
from test_nvidia import FakeGPUs as FakeNVIDIAGPUs
from torch import nn
from torchbridge_nvidia.probe import CUDAProperties

GB = 1024**3


def issues(report: torchbridge.compatibility.CompatibilityReport) -> dict[str, str]:
    return {i.what: f"{i.severity}: {i.detail}" for i in report.issues}


def fp8_model(dtype: torch.dtype) -> nn.Module:
    return nn.Linear(64, 64).to(dtype)


# -- FP8: what the device lists, whoever made it -------------------------------------------
@pytest.mark.parametrize(("gpu", "dtype"), [("MI300X", torch.float8_e4m3fnuz),
                                            ("MI300X", torch.float8_e5m2fnuz),
                                            ("MI355X", torch.float8_e4m3fn),
                                            ("RX 9070 XT", torch.float8_e5m2)])
def test_fp8_weights_in_a_dtype_the_amd_gpu_computes_are_compatible(
        monkeypatch: pytest.MonkeyPatch, gpu: str, dtype: torch.dtype) -> None:
    FakeAMDGPUs(monkeypatch, gpu)
    assert str(dtype).removeprefix("torch.") in \
        torchbridge.get_backend("rocm").get_device_info().supported_dtypes
    report = torchbridge.check_compatibility(fp8_model(dtype), backend="rocm")
    assert report.compatible and "fp8" not in issues(report), report.summary()


@pytest.mark.parametrize(("gpu", "dtype", "computes"), [
    ("MI300X", torch.float8_e4m3fn, "float8_e4m3fnuz, float8_e5m2fnuz"),
    ("MI355X", torch.float8_e4m3fnuz, "float8_e4m3fn, float8_e5m2")])
def test_the_other_fp8_encoding_is_named_as_such(monkeypatch: pytest.MonkeyPatch, gpu: str,
                                                 dtype: torch.dtype, computes: str) -> None:
    FakeAMDGPUs(monkeypatch, gpu)
    report = torchbridge.check_compatibility(fp8_model(dtype), backend="rocm")
    found = issues(report)["fp8"]
    assert not report.compatible
    assert found.startswith(f"error: {str(dtype).removeprefix('torch.')} weights")
    assert f"computes FP8 in {computes} only" in found and "240" in found
    assert "NVIDIA" not in found


def test_fp8_on_gpus_that_list_none_names_what_they_do_list(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeAMDGPUs(monkeypatch, "MI250X")  # CDNA2: no FP8
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn), backend="rocm")
    assert not report.compatible
    assert "lists no float8 dtype (it lists float32, float16, bfloat16)" in \
        issues(report)["fp8"]
    FakeNVIDIAGPUs(monkeypatch, "A100")
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn), backend="cuda")
    assert not report.compatible and "lists no float8 dtype" in issues(report)["fp8"]
    FakeNVIDIAGPUs(monkeypatch, "H100")
    assert torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn),
                                           backend="cuda").compatible


def test_a_gpu_its_plugin_does_not_know_is_not_said_to_lack_fp8(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNVIDIAGPUs(monkeypatch, "H100")
    fake.props = CUDAProperties("Future GPU", 13, 0, 200, 300 * GB)
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn), backend="cuda")
    assert report.compatible and "fp8" not in issues(report)
    assert any(n.startswith("fp8: float8_e4m3fn weights not checked: Future GPU is not in")
               for n in report.notes), report.notes


def test_fp8_on_intel_gpus_and_cpus_runs_through_onednn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeXPUs(monkeypatch, "Max 1550")
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn), backend="xpu")
    assert report.compatible and issues(report)["fp8"].startswith("slow: float8_e4m3fn")
    assert "oneDNN" in issues(report)["fp8"]
    # oneDNN on Intel GPUs refuses the fnuz encodings.
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fnuz), backend="xpu")
    assert not report.compatible
    assert "torch converts only float8_e4m3fn, float8_e5m2 there" in issues(report)["fp8"]
    # The CPU lists no float8 either, and torch's _scaled_mm runs all four on it.
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fnuz), backend="cpu")
    assert report.compatible and issues(report)["fp8"].startswith("slow")


def test_fp8_for_a_target_that_is_not_here_is_not_guessed() -> None:
    report = torchbridge.check_compatibility(fp8_model(torch.float8_e4m3fn), backend="rocm")
    assert report.compatible and "fp8" not in issues(report)
    assert any(n.startswith("fp8: float8_e4m3fn weights not checked: no rocm device")
               for n in report.notes), report.notes


# -- float64: refused where prepare_model refuses it, and nowhere else ---------------------
def test_float64_on_an_arc_a770_is_an_error_as_prepare_model_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeXPUs(monkeypatch, "Arc A770")
    model = nn.Linear(16, 16).double()
    report = torchbridge.check_compatibility(model, backend="xpu")
    assert not report.compatible
    found = issues(report)["float64"]
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement"]})
    with pytest.raises(torchbridge.UnsupportedDtypeError) as refused:
        torchbridge.get_backend("xpu", cfg).optimize(model, "O0")
    assert found == f"error: {refused.value}"
    # A float64 sample input is refused by both too.
    report = torchbridge.check_compatibility(nn.ReLU(), torch.randn(2, 16).double(),
                                             backend="xpu")
    assert "sample_input[0]" in issues(report)["float64"] and not report.compatible


@pytest.mark.parametrize(("backend", "fake", "gpu"), [
    ("cuda", FakeNVIDIAGPUs, "H100"), ("rocm", FakeAMDGPUs, "MI300X"),
    ("xpu", FakeXPUs, "Max 1550"), ("xpu", FakeXPUs, "Arc B580")])
def test_no_float64_claim_where_the_device_does_not_deny_it(
        monkeypatch: pytest.MonkeyPatch, backend: str, fake: type, gpu: str) -> None:
    fake(monkeypatch, gpu)
    report = torchbridge.check_compatibility(nn.Linear(16, 16).double(), backend=backend)
    assert report.compatible and "float64" not in issues(report), report.summary()


def test_float64_on_cpu_and_tpu_as_before() -> None:
    model = nn.Linear(16, 16).double()
    assert "float64" not in issues(torchbridge.check_compatibility(model, backend="cpu"))
    report = torchbridge.check_compatibility(model, backend="tpu")
    assert issues(report)["float64"].startswith("slow: TPUs have no float64 hardware")
    assert report.compatible
    # An Intel GPU that is not here may be an Arc A-series (no float64) or have it: no claim.
    assert "float64" not in issues(torchbridge.check_compatibility(model, backend="xpu"))
