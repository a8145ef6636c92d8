"""What the AMD plugin claims agrees with what torch and the HIP runtime will do: FP8 and MX
formats only where torch's ROCm gates allow them for the architecture and the ROCm torch
was built with (`_scaled_mm_allowed_device` in aten/src/ATen/native/cuda/ScaledBlas.cpp,
torch 2.13: gfx942; gfx1200/gfx1201 from ROCm 6.3; gfx950 from ROCm 6.5; MX formats on
gfx950 from ROCm 7.0), and a preflight that compares the xnack/sramecc settings a build's
code objects were made for (LLVM AMDGPUUsage, "Target Features"). Devices are replayed at
the probe seam as in test_amd."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchbridge
from test_amd import GB, FakeGPUs
from torch import nn
from torchbridge.kernels.choice import choose
from torchbridge_amd import probe
from torchbridge_amd.probe import ROCmProperties

# Passes that would touch torch's global BLAS/TF32 switches are out of these tests' way.
DISABLED = ["device_placement", "compile", "rocm_blas_library", "tf32"]


def _gpu(monkeypatch: pytest.MonkeyPatch, gcn: str, hip: str,
         build: tuple[str, ...] | None = None) -> FakeGPUs:
    """An Instinct part reporting `gcn`, on a torch built with HIP `hip`."""
    fake = FakeGPUs(monkeypatch, "MI300X", build=build or (gcn.split(":")[0],))
    fake.props = ROCmProperties("AMD Instinct", gcn, 304, 192 * GB, "0000:c1:00.0")
    monkeypatch.setattr(probe, "hip_version", lambda: hip)
    return fake


def _fp8_pass(monkeypatch: pytest.MonkeyPatch, **amd: object) -> tuple[str, str]:
    cfg = torchbridge.TorchBridgeConfig.load(optimization={"disabled_passes": DISABLED},
                                             hardware={"amd": amd})
    result = torchbridge.get_backend("rocm", cfg).optimize(
        nn.Sequential(nn.Linear(64, 64)).eval(), "O3")
    return next((p.status, p.detail) for p in result.passes if p.name == "fp8_linear")


def _fp8_kernels() -> dict[str, str | None]:
    choice = choose("linear", torchbridge.get_backend("rocm"), dtype=torch.bfloat16)
    return {c.implementation.name: c.reason for c in choice.candidates
            if c.implementation.name.startswith("rocm_fp8_linear")}


# -- FP8 on gfx940/gfx941 ------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gfx940", "gfx941"])
def test_no_fp8_on_the_pre_production_mi300s(monkeypatch: pytest.MonkeyPatch,
                                              arch: str) -> None:
    # torch's list is gfx942 alone among CDNA3 names; gfx940/941 FP8 MFMAs are never used.
    _gpu(monkeypatch, f"{arch}:sramecc+:xnack-", "7.0.51831")
    info = torchbridge.get_backend("rocm").get_device_info()
    assert info.architecture == arch and info.extra["fp8_dtype"] is None
    assert not any(d.startswith("float8") for d in info.supported_dtypes)
    status, detail = _fp8_pass(monkeypatch)
    assert status == "skipped" and f"torch's _scaled_mm refuses FP8 on {arch}" in detail
    assert _fp8_kernels()["rocm_fp8_linear_e4m3fnuz"] == \
        f"built for gfx942; the device is {arch}"
    from torchbridge.backends.amd import InvalidArchitectureError

    cfg = torchbridge.TorchBridgeConfig.load(strict=True, optimization={
        "disabled_passes": DISABLED}, hardware={"amd": {"fp8_enabled": True}})
    with pytest.raises(InvalidArchitectureError, match=f"refuses FP8 on {arch}"):
        torchbridge.get_backend("rocm", cfg).optimize(nn.Sequential(nn.Linear(64, 64)).eval(),
                                                      "O3")


# -- FP8 and MX formats by the ROCm torch was built with -----------------------------------
GATES = [  # gcnArchName, torch.version.hip, FP8 e4m3 dtype, MX formats, ROCm named as needed
    ("gfx950:sramecc+:xnack-", "6.4.43482-0f2d60242", None, [], "ROCm 6.5"),
    ("gfx950:sramecc+:xnack-", "6.5.0", "float8_e4m3fn", [], "ROCm 7.0"),
    ("gfx950:sramecc+:xnack-", "7.0.51831", "float8_e4m3fn", ["mxfp8", "mxfp4"], None),
    ("gfx1201", "6.2.41133-dd7f95766", None, [], "ROCm 6.3"),
    ("gfx1201", "6.3.42131", "float8_e4m3fn", [], None),
    ("gfx942:sramecc+:xnack-", "6.2.41133-dd7f95766", "float8_e4m3fnuz", [], None),
]


@pytest.mark.parametrize(("gcn", "hip", "fp8", "mx", "needs"), GATES)
def test_fp8_and_mx_only_where_this_rocm_allows_them(
        monkeypatch: pytest.MonkeyPatch, gcn: str, hip: str, fp8: str | None, mx: list[str],
        needs: str | None) -> None:
    _gpu(monkeypatch, gcn, hip)
    info = torchbridge.get_backend("rocm").get_device_info()
    assert info.extra["fp8_dtype"] == fp8 and info.extra["mx_formats"] == mx
    assert (fp8 in info.supported_dtypes) if fp8 else \
        not any(d.startswith("float8") for d in info.supported_dtypes)
    notes = info.notes or ""  # what this torch's ROCm withholds, and from which version
    assert (f"{needs}; this torch is built with HIP {hip}" in notes) if needs else \
        "this torch is built with HIP" not in notes
    status, detail = _fp8_pass(monkeypatch)
    assert status == ("applied" if fp8 else "skipped")
    if not fp8:
        assert detail == (f"torch's _scaled_mm allows FP8 on {info.architecture} from "
                          f"{needs}; this torch is built with HIP {hip}")
    eligible = [name for name, reason in _fp8_kernels().items() if reason is None]
    assert eligible == ([] if not fp8 else ["rocm_fp8_linear_e4m3fnuz"]
                        if fp8.endswith("fnuz") else ["rocm_fp8_linear_e4m3"])


def test_ocp_fp8_kernel_before_rocm_6_3_says_what_it_needs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _gpu(monkeypatch, "gfx1201", "6.2.41133-dd7f95766")
    assert _fp8_kernels()["rocm_fp8_linear_e4m3"] == (
        "torch's _scaled_mm allows FP8 on gfx950 from ROCm 6.5, gfx1200 from ROCm 6.3, "
        "gfx1201 from ROCm 6.3; this torch is built with HIP 6.2.41133-dd7f95766")
    # On 6.4 the OCP kernel serves RDNA4, not gfx950.
    _gpu(monkeypatch, "gfx950:sramecc+:xnack-", "6.4.43482")
    assert _fp8_kernels()["rocm_fp8_linear_e4m3"] == \
        "built for gfx1200, gfx1201; the device is gfx950"


def test_fp8_enabled_true_on_an_old_rocm_is_refused_with_the_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.amd import InvalidArchitectureError

    _gpu(monkeypatch, "gfx950:sramecc+:xnack-", "6.4.43482")
    status, detail = _fp8_pass(monkeypatch, fp8_enabled=True)
    assert status == "skipped" and detail.startswith(
        "config hardware.amd.fp8_enabled=True, but torch's _scaled_mm allows FP8 on gfx950 "
        "from ROCm 6.5")
    cfg = torchbridge.TorchBridgeConfig.load(strict=True, optimization={
        "disabled_passes": DISABLED}, hardware={"amd": {"fp8_enabled": True}})
    with pytest.raises(InvalidArchitectureError, match=r"from ROCm 6\.5"):
        torchbridge.get_backend("rocm", cfg).optimize(nn.Sequential(nn.Linear(64, 64)).eval(),
                                                      "O3")


def test_precision_policy_takes_the_hip_version() -> None:
    from torchbridge.backends.amd import precision_policy

    old = precision_policy("gfx950", "6.4.43482")
    assert old.fp8 is None and old.mx_formats == () and old.supported_dtypes[-1] == "bfloat16"
    assert old.withheld == ["FP8 on gfx950 needs ROCm 6.5; this torch is built with HIP "
                            "6.4.43482", "MX formats on gfx950 need ROCm 7.0; this torch is "
                            "built with HIP 6.4.43482"]
    assert precision_policy("gfx950", "7.1.25424").mx_formats == ("mxfp8", "mxfp4")
    # Without a version the architecture alone decides (a ROCm new enough for every gate).
    assert precision_policy("gfx950").fp8_dtype == torch.float8_e4m3fn
    assert precision_policy("gfx940").fp8 is None


# -- preflight: xnack and sramecc ----------------------------------------------------------
@pytest.mark.parametrize(("gcn", "build", "loads", "hint"), [
    ("gfx942:sramecc+:xnack+", ("gfx942:xnack-",), False, "HSA_XNACK=0"),
    ("gfx942:sramecc+:xnack-", ("gfx942:xnack+",), False, "HSA_XNACK=1"),
    ("gfx942:sramecc+:xnack-", ("gfx942:xnack-",), True, None),
    ("gfx942:sramecc+:xnack+", ("gfx942",), True, None),  # official wheels: no setting
    ("gfx942:sramecc+:xnack+", ("gfx942:xnack-", "gfx942:xnack+"), True, None),
    ("gfx942:sramecc+:xnack+", ("gfx9-4-generic:xnack-",), False, "HSA_XNACK=0"),
    ("gfx942:sramecc+:xnack+", ("gfx9-4-generic",), True, None),
    ("gfx90a:sramecc-:xnack-", ("gfx90a:sramecc+:xnack-",), False, "no sramecc setting"),
    ("gfx90a:sramecc+:xnack-", ("gfx90a:sramecc+",), True, None),
])
def test_build_entries_count_only_for_their_target_features(
        gcn: str, build: tuple[str, ...], loads: bool, hint: str | None) -> None:
    from torchbridge.backends.amd import run_preflight

    check = run_preflight("AMD Instinct (rocm:0)", gcn, build, "6.4.43482", True, {})
    assert check.kernels_available is loads
    if loads:
        assert check.warnings == []
    else:
        assert hint is not None and hint in check.warnings[0]
        assert "invalid device function" in check.warnings[0]
        assert check.hsa_override is None
        if "sramecc" in hint:
            assert "HSA_XNACK" not in check.warnings[0]  # SRAMECC is no per-process switch


def test_xnack_mismatch_warns_at_creation_and_in_the_notes(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    _gpu(monkeypatch, "gfx942:sramecc+:xnack+", "6.4.43482", build=("gfx942:xnack-",))
    with caplog.at_level(logging.WARNING, logger="torchbridge.amd"):
        backend = torchbridge.get_backend("rocm")
    warned = [r.getMessage() for r in caplog.records if r.name == "torchbridge.amd"]
    assert len(warned) == 1 and "gfx942 code only for gfx942:xnack-" in warned[0]
    info = backend.get_device_info()
    assert info.extra["preflight"]["kernels_available"] is False
    assert "HSA_XNACK=0" in (info.notes or "")


# -- docs -----------------------------------------------------------------------------------
def test_amd_doc_gives_mi100_bf16_as_the_code_does() -> None:
    from torchbridge.backends.amd import precision_policy

    doc = Path(__file__).parent.parent / "docs" / "backends" / "amd.md"
    if not doc.exists():
        pytest.skip("no docs/ beside the tests")
    text = " ".join(doc.read_text().split())
    assert precision_policy("gfx908").preferred_low_precision_dtype == "bfloat16"
    assert "bf16 on CDNA2+" not in text and "MI100's CDNA1 included" in text
    assert "never on the pre-production gfx940/941" in text
