"""The AMD plugin without a GPU: recorded properties of real devices at the probe seam, the
preflight against build arch lists, amdsmi present/absent/broken, FP8 numerics on CPU.
Tests that need an AMD GPU are marked `rocm`."""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torchbridge
from torch import nn
from torchbridge import devices
from torchbridge.types import ProbeResult
from torchbridge_amd import probe
from torchbridge_amd.probe import ROCmProperties

GB = 1024**3
# torch.cuda.get_device_properties() of AMD GPUs: (name, gcnArchName,
# multi_processor_count, total_memory in MiB). Written by hand from public specifications,
# not captured from a real device: AMD's published CU count and memory (product pages, ROCm
# "GPU hardware specifications"), with the name and gcnArchName as torch prints them for the
# part or its architecture in public bug reports (MI250X one GCD, MI300X, RX 7900 XTX,
# RX 9070 XT, Radeon 780M and 8060S; "gfx950:sramecc+:xnack-" from an MI355X).
RECORDED = {
    "MI100": ("AMD Instinct MI100", "gfx908:sramecc+:xnack-", 120, 32752),
    "MI210": ("AMD Instinct MI210", "gfx90a:sramecc+:xnack-", 104, 65520),
    "MI250X": ("AMD Instinct MI250X", "gfx90a:sramecc+:xnack-", 110, 65520),
    "MI300X": ("AMD Instinct MI300X", "gfx942:sramecc+:xnack-", 304, 196592),
    "MI325X": ("AMD Instinct MI325X", "gfx942:sramecc+:xnack-", 304, 262128),
    "MI355X": ("AMD Instinct MI355X", "gfx950:sramecc+:xnack-", 256, 294896),
    "RX 7900 XTX": ("Radeon RX 7900 XTX", "gfx1100", 48, 24560),
    "RX 9070 XT": ("AMD Radeon RX 9070 XT", "gfx1201", 32, 16304),
    "Radeon 780M": ("AMD Radeon 780M Graphics", "gfx1103", 6, 24576),  # RDNA3 APU
    "Radeon 8060S": ("Radeon 8060S Graphics", "gfx1151", 20, 64038),  # RDNA3.5 APU
}
EXPECTED = {  # architecture, family, FP8 e4m3 dtype, TF32, hipBLASLt
    "MI100": ("gfx908", "cdna1", None, False, False),
    "MI210": ("gfx90a", "cdna2", None, False, True),
    "MI250X": ("gfx90a", "cdna2", None, False, True),
    "MI300X": ("gfx942", "cdna3", "float8_e4m3fnuz", True, True),
    "MI325X": ("gfx942", "cdna3", "float8_e4m3fnuz", True, True),
    "MI355X": ("gfx950", "cdna4", "float8_e4m3fn", True, True),
    "RX 7900 XTX": ("gfx1100", "rdna3", None, False, True),
    "RX 9070 XT": ("gfx1201", "rdna4", "float8_e4m3fn", False, True),
    "Radeon 780M": ("gfx1103", "rdna3", None, False, False),
    "Radeon 8060S": ("gfx1151", "rdna3.5", None, False, False),
}
# A multi-architecture ROCm build's torch.cuda.get_arch_list().
BUILD = ("gfx900", "gfx906", "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1030", "gfx1100",
         "gfx1101", "gfx1102", "gfx1200", "gfx1201")


def props(gpu: str) -> ROCmProperties:
    name, arch, cus, mib = RECORDED[gpu]
    return ROCmProperties(name, arch, cus, mib * 1024 * 1024, "0000:c1:00.0")


class FakeGPUs:
    """The probe seam answering like a node with `count` GPUs of one kind, on a torch build
    for `build` architectures."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpu: str, count: int = 1,
                 build: tuple[str, ...] = BUILD) -> None:
        self.props = props(gpu)
        self.build = build
        self.free: int | None = None  # None: 2 GB under the total of the props in use
        self.telemetry: dict[str, float | None] | None = None
        self.flash_built = True
        monkeypatch.setattr(probe, "probe", lambda: ProbeResult(True, count, None))
        monkeypatch.setattr(probe, "device_properties", lambda i: self.props)
        monkeypatch.setattr(probe, "build_arch_list", lambda: self.build)
        # ROCm 7.0: torch's FP8 gate allows gfx950 from 6.5 and its MX formats from 7.0.
        monkeypatch.setattr(probe, "hip_version", lambda: "7.0.51831")
        monkeypatch.setattr(probe, "flash_attention_built", lambda: self.flash_built)
        monkeypatch.setattr(probe, "mem_get_info", lambda i: (
            self.props.total_memory - 2 * GB if self.free is None else self.free,
            self.props.total_memory))
        monkeypatch.setattr(probe, "allocator_counters", lambda i: (GB, 2 * GB, 3 * GB))
        monkeypatch.setattr(probe, "gpu_telemetry", lambda i, bus: self.telemetry)
        monkeypatch.delenv("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", raising=False)
        # The core checks a Detection against the devices torch sees: the recorded machine's.
        real_count = devices.runtime_device_count
        monkeypatch.setattr(devices, "runtime_device_count",
                            lambda kind: count if kind == "cuda" else real_count(kind))
        torchbridge.list_backends(rescan=True)


@pytest.fixture
def rocm_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str]]]:
    """The BLAS and flash-attention library switches behave as torch's do (called without an
    argument they say the current library, with one they set it) and record what they were
    set to, in order (the CPU build of torch refuses hipBLASLt); TF32 is put back
    afterwards. A prepared model's settings are put back when prepare_model returns (and
    set around its calls): the last records are those restores."""
    calls: list[tuple[str, str]] = []
    current = {"blas": "hipblas", "flash": "default"}

    def switch(kind: str) -> Any:
        def library(name: str | None = None) -> str:
            if name is not None:
                calls.append((kind, name))
                current[kind] = name
            return current[kind]
        return library

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", switch("blas"))
    monkeypatch.setattr(torch.backends.cuda, "preferred_rocm_fa_library", switch("flash"))
    monkeypatch.delenv("HIPBLASLT_ALLOW_TF32", raising=False)
    saved = torch.backends.cuda.matmul.allow_tf32
    yield calls
    torch.backends.cuda.matmul.allow_tf32 = saved


# -- discovery, architecture, precision policy --------------------------------------------
@pytest.mark.parametrize("gpu", list(RECORDED))
def test_recorded_devices_get_their_architecture_and_precision(
        monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    fake = FakeGPUs(monkeypatch, gpu, count=2)
    fake.telemetry = {"gpu_utilization_percent": 37.0, "power_watts": 312.0}
    assert torchbridge.detect_best_backend() == "rocm"
    backend = torchbridge.get_backend()
    info = backend.get_device_info(1)
    arch, family, fp8, tf32, _ = EXPECTED[gpu]
    name, gcn, cus, mib = RECORDED[gpu]
    assert (info.name, info.vendor, info.architecture) == (name, "AMD", arch)
    assert info.compute_capability == arch and info.extra["gcn_arch_name"] == gcn
    assert info.extra["family"] == family and info.extra["compute_units"] == cus
    assert info.preferred_low_precision_dtype == "bfloat16"  # every CDNA, and RDNA3+
    assert backend.low_precision_dtype(info) == torch.bfloat16
    assert info.extra["fp8_dtype"] == fp8
    assert (fp8 in info.supported_dtypes) if fp8 else \
        not any(d.startswith("float8") for d in info.supported_dtypes)
    if fp8 == "float8_e4m3fnuz":
        assert "float8_e5m2fnuz" in info.supported_dtypes
    assert info.extra["tf32"] is tf32
    assert info.extra["mx_formats"] == (["mxfp8", "mxfp4"] if arch == "gfx950" else [])
    assert info.memory_total_gb == pytest.approx(mib / 1024)
    assert info.memory_available_gb == pytest.approx(mib / 1024 - 2)
    # The recorded machine's torch has RCCL ("nccl"); this CPU build has none.
    assert info.device == "cuda:1"
    assert backend.distributed_backend == ("nccl" if dist.is_nccl_available() else None)
    assert backend.answered_by["torchbridge_device_info"] == "amd"
    telemetry = info.extra["telemetry"]  # every field, None where amdsmi gave nothing
    assert telemetry == {**dict.fromkeys(probe.TELEMETRY_FIELDS), **fake.telemetry}


def test_rdna2_has_fp16_but_not_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # RDNA2 has no matrix instructions (AMD RDNA2 ISA reference guide).
    fake = FakeGPUs(monkeypatch, "MI210")
    for gcn in ("gfx1030", "gfx1031", "gfx1032"):
        fake.props = ROCmProperties("Radeon RX 6000", gcn, 40, 12 * GB)
        info = torchbridge.get_backend("rocm").get_device_info()
        assert info.extra["family"] == "rdna2"
        assert info.supported_dtypes == ["float32", "float16"]
        assert info.preferred_low_precision_dtype == "float16"


def test_mi100_computes_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    # CDNA1's MFMA has bf16 (AMD "AMD matrix cores" lab notes: MI100 BF16 512 FLOPs/clock/CU).
    FakeGPUs(monkeypatch, "MI100")
    info = torchbridge.get_backend("rocm").get_device_info()
    assert (info.architecture, info.extra["family"]) == ("gfx908", "cdna1")
    assert info.supported_dtypes == ["float32", "float16", "bfloat16"]
    assert info.preferred_low_precision_dtype == "bfloat16"
    assert info.extra["tf32"] is False and info.extra["fp8_dtype"] is None


def test_gfx950_tf32_is_emulated_not_xf32(monkeypatch: pytest.MonkeyPatch) -> None:
    # gfx950 has no XF32 instructions; hipBLASLt emulates TF32 with bf16 MFMAs (hipBLASLt PR
    # 1806). gfx942 has XF32 (CDNA 3 ISA).
    fake = FakeGPUs(monkeypatch, "MI355X")
    info = torchbridge.get_backend("rocm").get_device_info()
    assert info.extra["tf32"] is True and info.extra["tf32_emulated"] is True
    assert info.extra["tf32_mode"] == ("TF32 emulated by hipBLASLt with bf16 matrix "
                                       "instructions (gfx950 has no XF32 instructions)")
    fake.props = props("MI300X")
    info = torchbridge.get_backend("rocm").get_device_info()
    assert info.extra["tf32"] is True and info.extra["tf32_emulated"] is False
    assert info.extra["tf32_mode"] == "TF32 (XF32) on the matrix cores of gfx942"
    fake.props = props("MI210")
    assert "has no TF32" in torchbridge.get_backend("rocm").get_device_info().extra["tf32_mode"]


def test_unknown_architecture_is_reported_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeGPUs(monkeypatch, "MI300X")
    fake.props = ROCmProperties("Future GPU", "gfx1250:sramecc+", 128, 432 * GB)
    info = torchbridge.get_backend("rocm").get_device_info()
    assert info.architecture == "unknown" and info.compute_capability == "gfx1250"
    assert info.preferred_low_precision_dtype is None and info.supported_dtypes == ["float32"]


def test_configured_architecture_fills_in_only_for_unknown_gpus(
        monkeypatch: pytest.MonkeyPatch, rocm_flags: list) -> None:
    fake = FakeGPUs(monkeypatch, "MI300X")
    fake.props = ROCmProperties("Future GPU", "gfx1250", 128, 432 * GB)
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement", "compile"]},
        hardware={"amd": {"architecture": "gfx950"}})
    backend = torchbridge.get_backend("rocm", cfg)
    info = backend.get_device_info()
    assert info.architecture == "gfx950" and info.extra["fp8_dtype"] == "float8_e4m3fn"
    assert "treated as gfx950" in (info.notes or "")
    mlp = nn.Sequential(nn.Linear(64, 64)).eval()
    status = {p.name: p.status for p in backend.optimize(mlp, "O3").passes}
    assert status["fp8_linear"] == "applied"

    report = _report(monkeypatch, "MI210", mlp, hardware={"amd": {"architecture": "gfx942"}})
    assert report["fp8_linear"][0] == "skipped"  # the MI210 is known: its table entry wins
    from torchbridge.backends.amd import InvalidArchitectureError

    with pytest.raises(InvalidArchitectureError, match="architecture=gfx942 but AMD Instinct "
                                                       "MI210 is gfx90a"):
        _report(monkeypatch, "MI210", mlp, strict=True,
                hardware={"amd": {"architecture": "gfx942"}})


# -- preflight ----------------------------------------------------------------------------
def test_hsa_override_values() -> None:
    from torchbridge.backends.amd import hsa_override_value

    assert [hsa_override_value(a) for a in ("gfx1030", "gfx1100", "gfx1151", "gfx1201",
                                            "gfx90a", "gfx942")] == \
        ["10.3.0", "11.0.0", "11.5.1", "12.0.1", "9.0.10", "9.4.2"]


@pytest.mark.parametrize("gpu", list(RECORDED))
def test_preflight_on_a_multi_arch_build(monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    FakeGPUs(monkeypatch, gpu)
    from torchbridge.backends.amd import AMDBackend

    check = AMDBackend().preflight()
    arch = EXPECTED[gpu][0]
    assert check.kernels_available is (arch in BUILD)
    if arch == "gfx1103":  # an RDNA3 APU the build lacks: run gfx1100's code
        assert check.hsa_override == "11.0.0"
        assert "HSA_OVERRIDE_GFX_VERSION=11.0.0" in check.warnings[0]
    if arch == "gfx1151":  # RDNA3.5: no 115x in the build, gfx1100 stands in
        assert check.hsa_override == "11.0.0"
    expected_flash = {"gfx908": "unsupported", "gfx1103": "unsupported",
                      "gfx1151": "experimental"}.get(arch, "available")
    assert check.flash_attention == expected_flash


def test_missing_datacenter_arch_warns_at_creation_and_in_doctor(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    FakeGPUs(monkeypatch, "MI300X", count=2, build=("gfx90a", "gfx1100"))
    with caplog.at_level(logging.WARNING, logger="torchbridge.amd"):
        backend = torchbridge.get_backend("rocm")
    warned = [r.getMessage() for r in caplog.records if r.name == "torchbridge.amd"]
    assert len(warned) == 2 and "AMD Instinct MI300X (rocm:1) is gfx942" in warned[1]
    assert "invalid device function" in warned[0] and "gfx90a, gfx1100" in warned[0]
    assert "HSA_OVERRIDE_GFX_VERSION" not in warned[0]  # not the fix for an Instinct part
    assert "PYTORCH_ROCM_ARCH=gfx942" in warned[0]
    assert "invalid device function" in (backend.get_device_info().notes or "")

    from torchbridge import doctor

    report = doctor.collect()
    assert report["selected"]["name"] == "rocm"
    assert "invalid device function" in report["selected"]["device_info"]["notes"]
    assert "invalid device function" in doctor.render(report)


def test_consumer_part_without_a_sibling_in_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.amd import run_preflight

    check = run_preflight("RX 7900 XTX", "gfx1100", ("gfx1030", "gfx942"), "6.4", True, {})
    assert check.kernels_available is False and check.hsa_override is None
    assert "HSA_OVERRIDE_GFX_VERSION cannot help here" in check.warnings[0]
    rdna2 = run_preflight("RX 6700 XT", "gfx1031", BUILD, "6.4", True, {})
    assert rdna2.hsa_override == "10.3.0"
    generic = run_preflight("780M", "gfx1103", ("gfx11-generic",), "7.0", True, {})
    assert generic.kernels_available is True and generic.warnings == []
    unknown_build = run_preflight("MI300X", "gfx942", (), None, True, {})
    assert unknown_build.kernels_available is None and unknown_build.warnings == []


def test_flash_attention_experimental_switch() -> None:
    from torchbridge.backends.amd import run_preflight

    off = run_preflight("8060S", "gfx1151", ("gfx1151",), "7.0", True, {})
    assert off.flash_attention == "experimental" and off.kernels_available is True
    assert "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1" in off.warnings[0]
    on = run_preflight("8060S", "gfx1151", ("gfx1151",), "7.0", True,
                       {"TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": "1"})
    assert on.flash_attention == "experimental (enabled)" and on.warnings == []
    assert run_preflight("MI300X", "gfx942", BUILD, "6.4", False, {}).flash_attention == \
        "not built"


# -- telemetry ------------------------------------------------------------------------------
def _fake_amdsmi(broken: set[str] | None = None) -> types.ModuleType:
    """amdsmi answering like an MI300X node of two GPUs: the second (PCI 0000:c1:00.0) is
    ours. MI300X reports no edge temperature and its current power as "N/A"."""
    broken = broken or set()
    mod = types.ModuleType("amdsmi")

    class AmdSmiLibraryException(Exception):
        pass

    def fail_if(name: str) -> None:
        if name in broken:
            raise AmdSmiLibraryException(f"{name}: AMDSMI_STATUS_NOT_SUPPORTED")

    mod.AmdSmiTemperatureType = types.SimpleNamespace(EDGE=0, HOTSPOT=1)  # type: ignore[attr-defined]
    mod.AmdSmiTemperatureMetric = types.SimpleNamespace(CURRENT=0)  # type: ignore[attr-defined]
    mod.amdsmi_init = lambda *a: fail_if("init")  # type: ignore[attr-defined]
    mod.amdsmi_shut_down = lambda: None  # type: ignore[attr-defined]
    mod.amdsmi_get_processor_handles = lambda: ["h0", "h1"]  # type: ignore[attr-defined]
    mod.amdsmi_get_gpu_device_bdf = (  # type: ignore[attr-defined]
        lambda h: {"h0": "0000:0c:00.0", "h1": "0000:C1:00.0"}[h])

    def activity(handle: str) -> dict[str, Any]:
        fail_if("activity")
        return {"gfx_activity": 37 if handle == "h1" else 99, "umc_activity": 12,
                "mm_activity": "N/A"}

    def temperature(handle: str, sensor: int, metric: int) -> int:
        if sensor == 0:
            raise AmdSmiLibraryException("AMDSMI_STATUS_NOT_SUPPORTED")
        return 54

    mod.amdsmi_get_gpu_activity = activity  # type: ignore[attr-defined]
    mod.amdsmi_get_temp_metric = temperature  # type: ignore[attr-defined]
    mod.amdsmi_get_power_info = lambda h: {  # type: ignore[attr-defined]
        "current_socket_power": "N/A", "average_socket_power": 312}
    mod.amdsmi_get_gpu_vram_usage = lambda h: {  # type: ignore[attr-defined]
        "vram_used": 1024, "vram_total": 196592}
    return mod


def test_telemetry_through_amdsmi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", _fake_amdsmi())
    assert probe.gpu_telemetry(0, "0000:c1:00.0") == {
        "gpu_utilization_percent": 37.0, "memory_utilization_percent": 12.0,
        "power_watts": 312.0, "temperature_c": 54.0, "vram_used_bytes": 1024 * 2**20,
        "vram_total_bytes": 196592 * 2**20}
    assert probe.gpu_telemetry(0, None)["gpu_utilization_percent"] == 99.0  # by index
    monkeypatch.setitem(sys.modules, "amdsmi", _fake_amdsmi({"activity"}))
    partial = probe.gpu_telemetry(0, "0000:c1:00.0")
    assert partial is not None and partial["gpu_utilization_percent"] is None
    assert partial["power_watts"] == 312.0  # one unsupported metric leaves the rest
    monkeypatch.setitem(sys.modules, "amdsmi", _fake_amdsmi({"init"}))
    assert probe.gpu_telemetry(0, None) is None


def test_without_amdsmi_telemetry_is_none_not_an_error(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # not installed: ImportError
    assert probe.gpu_telemetry(0, None) is None
    # Installed without its library, `import amdsmi` raises KeyError, not ImportError.
    monkeypatch.delitem(sys.modules, "amdsmi")
    (tmp_path / "amdsmi.py").write_text("raise KeyError('ROCM_PATH')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyError):
        import amdsmi  # noqa: F401
    assert probe.gpu_telemetry(0, None) is None

    FakeGPUs(monkeypatch, "MI300X")  # its probe finds no amdsmi either
    from torchbridge.backends.amd import AMDBackend

    assert AMDBackend().telemetry() == dict.fromkeys(probe.TELEMETRY_FIELDS)


# -- config, memory, API ------------------------------------------------------------------
def test_amd_config_section_is_merged_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__AMD__FP8_ENABLED", "false")
    config = torchbridge.TorchBridgeConfig.load(
        hardware={"amd": {"preferred_blas": "hipblas", "architecture": "GFX942:sramecc+"}})
    section = config.hardware.amd
    assert (section.fp8_enabled, section.preferred_blas, section.architecture) == \
        (False, "hipblas", "gfx942")
    with pytest.raises(torchbridge.ConfigurationError,
                       match=r"config key 'hardware\.amd\.max_memory_fraction' must be a "
                             r"number above 0 and at most 1, got 1\.5"):
        torchbridge.TorchBridgeConfig.load(hardware={"amd": {"max_memory_fraction": 1.5}})
    with pytest.raises(torchbridge.ConfigurationError,
                       match=r"hardware\.amd\.architecture.*'gfx9999' is not an architecture"):
        torchbridge.TorchBridgeConfig.load(hardware={"amd": {"architecture": "gfx9999"}})
    with pytest.raises(torchbridge.ConfigurationError, match=r"hardware\.amd\.preferred_blas"):
        torchbridge.TorchBridgeConfig.load(hardware={"amd": {"preferred_blas": "rocblas"}})


def test_memory_stats_fraction_and_pool_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.amd import AMDMemoryManager

    fake = FakeGPUs(monkeypatch, "MI250X", count=2)
    stats = torchbridge.get_backend("rocm").get_memory_stats()
    assert (stats.total_bytes, stats.free_bytes) == (fake.props.total_memory,
                                                   fake.props.total_memory - 2 * GB)
    assert (stats.allocated_bytes, stats.reserved_bytes, stats.peak_allocated_bytes) == \
        (GB, 2 * GB, 3 * GB)
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, d: calls.append((f, d)))
    config = torchbridge.TorchBridgeConfig.load(
        memory={"max_memory_fraction": 0.5},
        hardware={"amd": {"max_memory_fraction": 0.8, "pool_max_tensors": 3}})
    manager = AMDMemoryManager(config=config)
    assert calls == [(0.8, torch.device("cuda", 0)), (0.8, torch.device("cuda", 1))]
    assert manager.pool_max_tensors == 3


def test_oom_protection_raises_the_amd_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.amd import AMDMemoryManager, OutOfMemoryError

    fake = FakeGPUs(monkeypatch, "RX 7900 XTX")
    fake.free = 100 * 1024 * 1024
    # Nothing reserved and unused by this process's allocator, which would count as free.
    monkeypatch.setattr(probe, "allocator_counters", lambda i: (2 * GB, 2 * GB, 3 * GB))
    manager = AMDMemoryManager(torchbridge.get_backend("rocm"))
    with pytest.raises(OutOfMemoryError, match=r"requested 90\.0 MiB.*free 100\.0 MiB"):
        manager.allocate_with_oom_protection((1024, 1024, 90), torch.uint8, safety_margin=1.2)
    assert issubclass(OutOfMemoryError, torchbridge.OutOfMemoryError)
    assert issubclass(OutOfMemoryError, torch.OutOfMemoryError)


def test_without_rocm_the_amd_api_says_so() -> None:
    from torchbridge.backends.amd import AMDBackend, ROCmNotAvailableError

    with pytest.raises(ROCmNotAvailableError, match=r"not a ROCm build|no AMD GPU visible"):
        AMDBackend()
    assert issubclass(ROCmNotAvailableError, torchbridge.BackendUnavailableError)


def test_seed_shaped_amd_backend(monkeypatch: pytest.MonkeyPatch, rocm_flags: list) -> None:
    from torchbridge.backends.amd import AMDBackend, AMDOptimizer

    FakeGPUs(monkeypatch, "MI300X", count=2)
    backend = AMDBackend(optimization_level="O3", device_id=1)
    assert backend.config.optimization_level.value == "O3"
    assert backend.device == torch.device("cuda", 1) and backend.architecture == "gfx942"
    assert backend.get_memory_stats()["allocated"] == 1024.0  # the seeds' MB view
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement", "compile"]})
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    result = AMDOptimizer(cfg).optimize(model, optimization_level="aggressive")
    assert result.optimizations_applied == ["rocm_blas_library", "tf32", "fp8_linear",
                                            "autocast"]
    assert rocm_flags == [("blas", "hipblaslt"), ("blas", "hipblas")]  # set, then scoped


# -- passes -------------------------------------------------------------------------------
def _report(monkeypatch: pytest.MonkeyPatch, gpu: str, model: nn.Module, level: str = "O3",
            disabled: tuple[str, ...] = ("device_placement", "compile"), **config: Any
            ) -> dict[str, tuple[str, str]]:
    FakeGPUs(monkeypatch, gpu)
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": list(disabled)}, **config)
    result = torchbridge.get_backend("rocm", cfg).optimize(model, level)
    return {p.name: (p.status, p.detail) for p in result.passes}


@pytest.mark.parametrize("gpu", list(RECORDED))
def test_passes_follow_the_architecture(monkeypatch: pytest.MonkeyPatch, gpu: str,
                                        rocm_flags: list) -> None:
    arch, _, fp8, tf32, hipblaslt = EXPECTED[gpu]
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    report = _report(monkeypatch, gpu, mlp, disabled=("device_placement",))
    assert report["autocast"][0] == "applied" and report["compile"][0] == "applied"
    if hipblaslt:
        assert report["rocm_blas_library"][0] == "applied"
        assert rocm_flags == [("blas", "hipblaslt"), ("blas", "hipblas")]  # set, then scoped
    else:
        assert report["rocm_blas_library"] == ("skipped", (
            "torch supports hipblaslt on gfx90a, gfx942, gfx950, gfx1100, gfx1101, gfx1200, "
            f"gfx1201, not {arch}; hipBLAS (torch's default there) stays"))
    assert report["tf32"][0] == ("applied" if tf32 else "skipped")
    assert (os.environ.get("HIPBLASLT_ALLOW_TF32") == "1") is tf32  # torch's ROCm TF32 gate
    assert report["rocm_flash_attention"][0] == "skipped"
    assert "auto keeps torch's default library (AOTriton)" in report["rocm_flash_attention"][1]
    if fp8:
        assert report["fp8_linear"][0] == "applied"
    else:
        assert report["fp8_linear"] == ("skipped", (
            f"{arch} has no FP8 matrix cores that torch uses (gfx94x, gfx950, gfx1200/gfx1201 "
            "do)"))


def test_fp8_asked_for_where_there_is_none(monkeypatch: pytest.MonkeyPatch,
                                           rocm_flags: list) -> None:
    from torchbridge.backends.amd import InvalidArchitectureError

    mlp = nn.Sequential(nn.Linear(64, 64)).eval()
    report = _report(monkeypatch, "MI210", mlp, hardware={"amd": {"fp8_enabled": True}})
    assert report["fp8_linear"][1].startswith("config hardware.amd.fp8_enabled=True, but "
                                              "gfx90a has no FP8")
    with pytest.raises(InvalidArchitectureError, match="fp8_enabled=True, but gfx90a"):
        _report(monkeypatch, "MI210", mlp, strict=True, hardware={"amd": {"fp8_enabled": True}})
    report = _report(monkeypatch, "MI300X", mlp, hardware={"amd": {"fp8_enabled": False}})
    assert report["fp8_linear"] == ("skipped", "config hardware.amd.fp8_enabled is off")


def test_library_choices_and_their_skip_reasons(monkeypatch: pytest.MonkeyPatch,
                                                rocm_flags: list) -> None:
    from torchbridge.backends.amd import InvalidArchitectureError

    mlp = nn.Sequential(nn.Linear(64, 64)).eval()
    report = _report(monkeypatch, "MI300X", mlp, hardware={"amd": {
        "flash_attention_library": "ck", "preferred_blas": "ck"}})
    assert report["rocm_flash_attention"][0] == report["rocm_blas_library"][0] == "applied"
    assert rocm_flags[:2] == [("blas", "ck"), ("flash", "ck")]
    report = _report(monkeypatch, "RX 7900 XTX", mlp,
                     hardware={"amd": {"flash_attention_library": "ck"}})
    assert report["rocm_flash_attention"] == ("skipped", (
        "config hardware.amd.flash_attention_library='ck', but torch allows CK flash "
        "attention on gfx90a, gfx942 only, not gfx1100"))
    with pytest.raises(InvalidArchitectureError, match="flash_attention_library='aotriton'"):
        _report(monkeypatch, "Radeon 8060S", mlp, strict=True,
                hardware={"amd": {"flash_attention_library": "aotriton"}})
    monkeypatch.setenv("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL", "1")
    fake_env_report = _report(monkeypatch, "Radeon 8060S", mlp,
                              hardware={"amd": {"flash_attention_library": "aotriton"}})
    # FakeGPUs clears the switch; the report says what to set.
    assert "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL=1 enables it" in \
        fake_env_report["rocm_flash_attention"][1]
    report = _report(monkeypatch, "MI300X", mlp, hardware={"amd": {"allow_tf32": False}})
    assert report["tf32"] == ("skipped", "config hardware.amd.allow_tf32 is off")


def test_training_models_get_no_fp8(monkeypatch: pytest.MonkeyPatch, rocm_flags: list) -> None:
    report = _report(monkeypatch, "MI355X", nn.Linear(16, 16).train())
    assert report["fp8_linear"][0] == "skipped"


# -- FP8 numerics on CPU ------------------------------------------------------------------
# e4m3 keeps 3 mantissa bits whether OCP (max 448) or fnuz (max 240): about 2.6% RMS rounding
# error per operand; the NVIDIA tests measured 3.7% relative error for random layers.
FP8_TOLERANCE = 0.08


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_fp8_linear_in_each_dtype_matches_fp32(dtype: torch.dtype) -> None:
    from torchbridge.fp8 import FP8Linear, quantization_max, quantize_fp8

    torch.manual_seed(0)
    linear = nn.Linear(256, 128)
    fp8 = FP8Linear.from_linear(linear, fp8_dtype=dtype)
    assert fp8.weight_fp8.dtype == dtype
    x = torch.randn(4, 32, 256)
    with torch.no_grad():
        expected, got = linear(x), fp8(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert _rel(got, expected) < FP8_TOLERANCE
    q, scale = quantize_fp8(x, dtype)
    # The amax maps onto the top value (224 for fnuz, vLLM's choice, 448 for OCP e4m3).
    assert q.float().abs().max() == quantization_max(dtype) == \
        (224.0 if dtype == torch.float8_e4m3fnuz else 448.0)
    assert _rel(q.float() * scale, x) < 0.05


def test_amd_o3_model_runs_fp8_in_the_architectures_dtype(
        monkeypatch: pytest.MonkeyPatch, rocm_flags: list) -> None:
    from torchbridge.fp8 import FP8Linear

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    x = torch.randn(8, 64)
    with torch.no_grad():
        expected = model(x)
    for gpu, dtype in (("MI300X", torch.float8_e4m3fnuz), ("RX 9070 XT", torch.float8_e4m3fn)):
        FakeGPUs(monkeypatch, gpu)
        cfg = torchbridge.TorchBridgeConfig.load(
            optimization={"disabled_passes": ["device_placement", "compile"]})
        prepared = torchbridge.get_backend("rocm", cfg).optimize(model, "O3").model
        layers = [m for m in prepared.modules() if isinstance(m, FP8Linear)]
        assert len(layers) == 2 and {m.weight_fp8.dtype for m in layers} == {dtype}
        with torch.no_grad():  # the class's forward: cuda autocast cannot run on this CPU
            assert _rel(nn.Sequential.forward(prepared, x), expected) < FP8_TOLERANCE


# -- on a real AMD GPU ----------------------------------------------------------------------
@pytest.mark.rocm
def test_on_a_real_amd_gpu_description_preflight_and_memory() -> None:
    from torchbridge.backends.amd import AMDBackend

    backend = AMDBackend()
    info = backend.get_device_info()
    assert info.architecture != "unknown", info.extra["gcn_arch_name"]
    assert backend.preflight().kernels_available is True
    stats = backend.get_memory_stats()
    x = torch.empty(1024, 1024, device=backend.device)
    assert backend.get_memory_stats().allocated_bytes >= stats.allocated_bytes + x.nbytes
    assert set(backend.telemetry()) == set(probe.TELEMETRY_FIELDS)


@pytest.mark.rocm
def test_on_a_real_amd_gpu_fp8_linear_matches() -> None:
    from torchbridge.fp8 import FP8Linear

    backend = torchbridge.get_backend("rocm")
    dtype = backend.get_device_info().extra["fp8_dtype"]
    if dtype is None:
        pytest.skip("this GPU has no FP8 matrix cores torch uses")
    torch.manual_seed(0)
    linear = nn.Linear(256, 128).to(backend.device)
    fp8 = FP8Linear.from_linear(linear, fp8_dtype=getattr(torch, dtype))
    x = torch.randn(64, 256, device=backend.device)
    with torch.no_grad():
        assert _rel(fp8(x), linear(x)) < FP8_TOLERANCE


@pytest.mark.rocm
def test_on_a_real_amd_gpu_flash_attention_matches_the_preflight() -> None:
    """The table's flash-attention verdict against what SDPA really does on this GPU."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torchbridge.backends.amd import AMDBackend

    backend = AMDBackend()
    status = backend.preflight().flash_attention
    q = torch.randn(2, 4, 128, 64, device=backend.device, dtype=torch.float16)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        if status in ("available", "experimental (enabled)"):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            with sdpa_kernel(SDPBackend.MATH):
                reference = torch.nn.functional.scaled_dot_product_attention(q, q, q)
            torch.testing.assert_close(out, reference, atol=2e-3, rtol=2e-3)
        else:
            with pytest.raises(RuntimeError, match="No available kernel"):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)


@pytest.mark.rocm
def test_on_a_real_amd_gpu_the_blas_pass_sets_the_library() -> None:
    backend = torchbridge.get_backend("rocm")
    result = backend.optimize(nn.Linear(64, 64), "O1")
    status = {p.name: p.status for p in result.passes}["rocm_blas_library"]
    if status == "applied":
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
