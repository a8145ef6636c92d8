"""The Intel plugin without an Intel GPU: recorded properties of real devices at the probe
seam (torchbridge_intel/probe.py) for family, precision policy, fp64 refusal, distributed
backend and passes. Tests that need an Intel GPU are marked `xpu`."""

from __future__ import annotations

import copy
import dataclasses
import sys
import types

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import devices
from torchbridge.types import ProbeResult
from torchbridge_intel import probe
from torchbridge_intel.probe import IPEXStatus, XPUProperties

MiB, GB = 1024**2, 1024**3

# torch.xpu.get_device_properties() of Intel GPUs, written by hand from public
# specifications and the properties torch printed in the public issues cited per device, not
# captured from a real device. Where a field is not in the issue cited, the value is the
# part's published specification (noted per device); a field the cited torch did not have
# is None, as the probe reads it on that torch.
RECORDED = {
    # torch-xpu-ops CI (intel/torch-xpu-ops#3889, torch 2.13): name, device_id, driver,
    # total_memory=65520MB, 512 compute units/EUs, 64 subslices, sub_group_sizes [16 32],
    # has_fp16=1, has_fp64=1, is_integrated_gpu=0. Xe-HPC has XMX with bf16 and TF32.
    "Max 1550": XPUProperties(
        "Intel(R) Data Center GPU Max 1550", 65520 * MiB, 512, 512, 64, 0x0BD5,
        "1.6.33578+51", 0x000000030F000700, False, True, True, True, True, True, (16, 32)),
    # intel/torch-xpu-ops#4117: total_memory=49136MB, 448 compute units/EUs, 56 subslices.
    "Max 1100": XPUProperties(
        "Intel(R) Data Center GPU Max 1100", 49136 * MiB, 448, 448, 56, 0x0BDA,
        "1.6.33578+51", 0x000000030F000700, False, True, True, True, True, True, (16, 32)),
    # torch 2.7.0+xpu (stas00/ml-engineering#107): total_memory=15473MB, 512/512, 32
    # subslices, sub_group_sizes [8 16 32], has_fp16=1, has_fp64=0; that torch reported
    # no device_id or is_integrated_gpu. Alchemist has XMX (bf16, no TF32 DPAS).
    "Arc A770": XPUProperties(
        "Intel(R) Arc(TM) A770 Graphics", 15473 * MiB, 512, 512, 32, None, "1.6.33578",
        0x000000030DC00800, None, True, False, True, True, False, (8, 16, 32)),
    # PCI id 0xE20B and 160 EUs / 20 Xe2 cores (the B-series die, intel/torch-xpu-ops#5258
    # for the Pro B60); 12 GB GDDR6 from the specification. Xe2 has fp64 and XMX.
    "Arc B580": XPUProperties(
        "Intel(R) Arc(TM) B580 Graphics", 12 * GB, 160, 160, 20, 0xE20B, "1.6.33578+51",
        0x0000000500400400, False, True, True, True, True, None, (16, 32)),
    # Lunar Lake Core Ultra 7 258V: Arc 140V, 8 Xe2 cores (64 EUs), PCI id 0x64A0, shares
    # the 16 GB of system memory (specification values).
    "Arc 140V": XPUProperties(
        "Intel(R) Arc(TM) 140V GPU (16GB)", 16 * GB, 64, 64, 8, 0x64A0, "1.6.32224+14",
        0x0000000501000400, True, True, True, True, True, None, (16, 32)),
    # Meteor Lake Core Ultra 7 155H: torch.xpu.get_device_capability() printed in
    # intel/intel-xpu-backend-for-triton#1888 (128 EUs, 8 subslices, has_fp16, has_fp64,
    # no bf16 conversions, no XMX, driver 1.3.29735); PCI id 0x7D55 from xpu-smi on the
    # same part (intel/ipex-llm#11605); that torch reported no architecture.
    "Meteor Lake": XPUProperties(
        "Intel(R) Arc(TM) Graphics", 14 * GB, 128, 128, 8, 0x7D55, "1.3.29735", None, True,
        True, True, False, False, False, (8, 16, 32)),
}
# TF32 in DeviceInfo.extra["tf32"]: Xe-HPC and Xe2 XMX multiply TF32, Alchemist's does not
# (SYCL joint_matrix combinations per architecture, intel/llvm device_info.hpp); Meteor Lake
# has no XMX. torch.xpu.is_tf32_supported() says True for all with XMX (FakeXPUs keeps it).
TF32 = {"Max 1550": True, "Max 1100": True, "Arc A770": False, "Arc B580": True,
        "Arc 140V": True, "Meteor Lake": False}
EXPECTED = {  # family, how it was identified, IP version, preferred dtype, fp64
    "Max 1550": ("ponte_vecchio", "architecture", "12.60.7", "bfloat16", True),
    "Max 1100": ("ponte_vecchio", "architecture", "12.60.7", "bfloat16", True),
    "Arc A770": ("alchemist", "architecture", "12.55.8", "bfloat16", False),
    "Arc B580": ("battlemage", "architecture", "20.1.4", "bfloat16", True),
    "Arc 140V": ("lunar_lake", "architecture", "20.4.4", "bfloat16", True),
    "Meteor Lake": ("meteor_arrow_lake", "device id", None, "float16", True),
}


class FakeXPUs:
    """The probe seam answering like a machine with `count` Intel GPUs of one kind."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpu: str, count: int = 1) -> None:
        self.props = RECORDED[gpu]
        self.free = (self.props.total_memory or 0) - GB
        self.xccl = (True, "XCCL is built into this torch")
        self.calls: list[str] = []
        monkeypatch.setattr(probe, "probe", lambda: ProbeResult(True, count, None))
        monkeypatch.setattr(probe, "device_properties", lambda i: self.props)
        # torch 2.13's rule: TF32 where the device has DPAS (torch.xpu.is_tf32_supported).
        monkeypatch.setattr(probe, "tf32_supported",
                            lambda i: self.props.has_subgroup_matrix_multiply_accumulate)
        monkeypatch.setattr(probe, "mem_get_info",
                            lambda i: (self.free, self.props.total_memory))
        monkeypatch.setattr(probe, "allocator_counters", lambda i: (GB, 2 * GB, 3 * GB))
        monkeypatch.setattr(probe, "xccl_status", lambda: self.xccl)
        monkeypatch.setattr(probe, "ipex_status", lambda: IPEXStatus(
            False, None, "intel-extension-for-pytorch is not installed"))
        monkeypatch.setattr(probe, "triton_xpu_status",
                            lambda: (False, "no Triton with the Intel XPU backend"))
        for name in ("synchronize", "reset_peak_memory_stats"):
            monkeypatch.setattr(probe, name, lambda i, name=name: self.calls.append(name))
        monkeypatch.setattr(probe, "empty_cache", lambda: self.calls.append("empty_cache"))
        # The oneDNN TF32 flag as a torch with XPU support holds it (this CPU build's
        # ignores the setter).
        self.tf32: bool | None = False
        monkeypatch.setattr(probe, "enable_tf32", lambda: (self.calls.append("enable_tf32"),
                                                           self._set_tf32(True)))
        monkeypatch.setattr(probe, "tf32_enabled", lambda: self.tf32)
        monkeypatch.setattr(probe, "set_tf32", self._set_tf32)
        real_count = devices.runtime_device_count
        monkeypatch.setattr(devices, "runtime_device_count",
                            lambda kind: count if kind == "xpu" else real_count(kind))
        torchbridge.list_backends(rescan=True)

    def _set_tf32(self, allowed: bool | None) -> None:
        self.tf32 = allowed

    def replace(self, **changes: object) -> None:
        self.props = dataclasses.replace(self.props, **changes)


# -- discovery, family, precision policy ---------------------------------------------------
@pytest.mark.parametrize("gpu", list(RECORDED))
def test_recorded_devices_get_their_family_and_precision(monkeypatch: pytest.MonkeyPatch,
                                                         gpu: str) -> None:
    FakeXPUs(monkeypatch, gpu, count=2)
    assert torchbridge.detect_best_backend() == "xpu"
    backend = torchbridge.get_backend()
    info = backend.get_device_info(1)
    family, source, ip, preferred, fp64 = EXPECTED[gpu]
    props = RECORDED[gpu]
    assert (info.name, info.vendor, info.architecture) == (props.name, "Intel", family)
    assert (info.extra["identified_by"], info.compute_capability) == (source, ip)
    assert info.preferred_low_precision_dtype == preferred
    assert backend.low_precision_dtype(info) == getattr(torch, preferred)
    assert ("float64" in info.supported_dtypes) is fp64
    assert info.extra["fp64"] is fp64
    assert "float16" in info.supported_dtypes and "float32" in info.supported_dtypes
    assert info.extra["xmx"] is (preferred == "bfloat16")
    assert info.extra["tf32"] is TF32[gpu]
    assert info.extra["eu_count"] == props.gpu_eu_count
    assert info.extra["integrated"] is props.is_integrated_gpu
    assert info.memory_total_gb == pytest.approx(props.total_memory / GB)
    assert info.memory_available_gb == pytest.approx(props.total_memory / GB - 1)
    assert info.device == "xpu:1"
    assert backend.answered_by["torchbridge_device_info"] == "intel"


def test_a_part_no_table_knows_is_described_by_its_capabilities(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeXPUs(monkeypatch, "Arc B580")
    fake.replace(name="Intel(R) Graphics [0xfff0]", device_id=0xFFF0,
                 architecture=(40 << 22) << 8)  # IP version 40.0.0: in no table
    info = torchbridge.get_backend("xpu").get_device_info()
    assert info.architecture == "unknown" and info.extra["identified_by"] == "none"
    assert info.compute_capability == "40.0.0"  # the decoded IP version, reported as is
    assert "not in this plugin's family tables" in info.notes
    assert info.preferred_low_precision_dtype == "bfloat16"  # its capabilities say so
    # The 2024 Meteor Lake record as that torch reported it: no architecture, no device id.
    fake.props = dataclasses.replace(RECORDED["Meteor Lake"], device_id=None,
                                     is_integrated_gpu=None)
    info = torchbridge.get_backend("xpu").get_device_info()
    assert info.architecture == "unknown"  # "Arc(TM) Graphics" alone names no one family
    assert info.preferred_low_precision_dtype == "float16"


def test_family_from_the_name_only_where_the_name_is_unambiguous() -> None:
    from torchbridge_intel.families import IntelFamily, identify

    bare = dict(architecture=None, device_id=None)
    max1550 = dataclasses.replace(RECORDED["Max 1550"], **bare)
    assert identify(max1550).family is IntelFamily.PONTE_VECCHIO
    assert identify(max1550).source == "name"
    assert identify(dataclasses.replace(RECORDED["Arc A770"], **bare)).family is \
        IntelFamily.ALCHEMIST
    assert identify(dataclasses.replace(RECORDED["Arc 140V"], **bare)).family is \
        IntelFamily.LUNAR_LAKE
    b580 = dataclasses.replace(RECORDED["Arc B580"], **bare)
    assert identify(b580).family is IntelFamily.BATTLEMAGE
    # Panther Lake's integrated Arc B390 is Xe3, not Battlemage: an integrated "Arc B" part,
    # or one whose torch does not say, is not guessed.
    ptl = dataclasses.replace(b580, name="Intel(R) Arc(TM) B390 GPU", is_integrated_gpu=True)
    assert identify(ptl).family is IntelFamily.UNKNOWN
    assert identify(dataclasses.replace(ptl, is_integrated_gpu=None)).family is \
        IntelFamily.UNKNOWN
    assert identify(dataclasses.replace(ptl, device_id=0xB080)).family is \
        IntelFamily.PANTHER_LAKE


def test_architecture_ids_decode_to_ip_versions() -> None:
    from torchbridge_intel.families import ip_version

    # intel/llvm device_architecture.def: intel_gpu_pvc, _acm_g10, _bmg_g21, _lnl_m, _ptl_h
    assert ip_version(0x000000030F000700) == (12, 60, 7)
    assert ip_version(0x000000030DC00800) == (12, 55, 8)
    assert ip_version(0x0000000500400400) == (20, 1, 4)
    assert ip_version(0x0000000501000400) == (20, 4, 4)
    assert ip_version(0x0000000780000400) == (30, 0, 4)
    for not_an_intel_gpu in (0x0100000000009000, 0x0300000000000800, 0x9900000000000000,
                             0x030DC008, None, -1):
        assert ip_version(not_an_intel_gpu) is None


def test_xmx_reported_absent_on_an_xmx_family_is_flagged_not_overruled(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pytorch#196074: on a B580 without a loadable libocloc every capability flag reads
    False. The policy follows what torch reports (no bf16) and the description says why."""
    fake = FakeXPUs(monkeypatch, "Arc B580")
    fake.replace(has_subgroup_matrix_multiply_accumulate=False)  # bf16 converts, no XMX
    info = torchbridge.get_backend("xpu").get_device_info()
    assert info.preferred_low_precision_dtype == "float16"
    assert "bfloat16" in info.supported_dtypes
    fake.replace(has_bfloat16_conversions=False)
    info = torchbridge.get_backend("xpu").get_device_info()
    assert info.architecture == "battlemage"
    assert info.preferred_low_precision_dtype == "float16"
    assert "pytorch#196074" in info.notes


def test_precision_config_can_lower_but_not_invent(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeXPUs(monkeypatch, "Meteor Lake")
    cfg = torchbridge.TorchBridgeConfig.load(hardware={"intel": {"precision": "bfloat16"}})
    info = torchbridge.get_backend("xpu", cfg).get_device_info()
    assert info.preferred_low_precision_dtype == "float16"
    assert "precision=bfloat16, but Intel(R) Arc(TM) Graphics does not compute in " \
           "bfloat16; using float16" in info.notes
    cfg = torchbridge.TorchBridgeConfig.load(hardware={"intel": {"precision": "float32"}})
    backend = torchbridge.get_backend("xpu", cfg)
    assert backend.get_device_info().preferred_low_precision_dtype is None
    result = backend.optimize(nn.Linear(8, 8).eval(), "O2")
    assert {p.name: p.status for p in result.passes}["autocast"] == "skipped"


# -- fp64 ---------------------------------------------------------------------------------
def _optimize(monkeypatch: pytest.MonkeyPatch, gpu: str, model: nn.Module, level: str = "O3",
              fake: FakeXPUs | None = None, **config: object) -> torchbridge.OptimizationResult:
    if fake is None:
        FakeXPUs(monkeypatch, gpu)
    # No XPU to place on: the core's placement pass is tested elsewhere.
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement"]}, **config)
    return torchbridge.get_backend("xpu", cfg).optimize(model, level)


def test_float64_model_on_arc_is_refused_before_placement_in_every_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.intel import UnsupportedDtypeError  # the core's, by its old name

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).double().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for level, strict in (("O0", False), ("O2", False), ("O3", True)):
        with pytest.raises(UnsupportedDtypeError, match="has no float64 support") as info:
            _optimize(monkeypatch, "Arc A770", model, level, strict=strict)
        assert "float64 tensors (0.weight, 0.bias, 1.weight, 1.bias, 1.running_mean and 1 " \
               "more)" in str(info.value) and ".float()" in str(info.value)
        assert isinstance(info.value, torchbridge.UnsupportedDtypeError)
        assert isinstance(info.value, torchbridge.ModelOptimizationError)
    # Nothing was placed or changed.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # The facts a compatibility check reads, without running anything:
    device = torchbridge.get_backend("xpu").get_device_info()
    assert "float64" not in device.supported_dtypes and device.extra["fp64"] is False


def test_float64_runs_where_the_device_has_it_and_float32_is_not_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    result = _optimize(monkeypatch, "Max 1550", nn.Linear(4, 4).double(), "O0")
    assert not result.failed
    result = _optimize(monkeypatch, "Arc A770", nn.Linear(4, 4), "O0")
    assert not result.failed


def test_float64_sample_input_counts_too(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeXPUs(monkeypatch, "Arc A770")
    backend = torchbridge.get_backend("xpu")
    for sample in ({"x": torch.zeros(2, 2, dtype=torch.float64)},
                   (torch.zeros(2, 2, dtype=torch.float64),)):
        with pytest.raises(torchbridge.UnsupportedDtypeError, match=r"sample_input\[0\]"):
            backend.optimize(nn.Linear(2, 2), "O0", sample_input=sample)


# -- passes --------------------------------------------------------------------------------
@pytest.mark.parametrize("gpu", list(RECORDED))
def test_passes_follow_the_capabilities(monkeypatch: pytest.MonkeyPatch, gpu: str) -> None:
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    fake = FakeXPUs(monkeypatch, gpu)
    result = _optimize(monkeypatch, gpu, mlp, fake=fake)
    report = {p.name: (p.status, p.detail) for p in result.passes}
    assert report["tf32"][0] == ("applied" if TF32[gpu] else "skipped")
    assert ("enable_tf32" in fake.calls) is TF32[gpu]
    assert report["autocast"][0] == "applied"
    assert report["low_precision_weights"][0] == "applied"  # stored in the autocast dtype
    assert result.model[0].weight.dtype == getattr(torch, EXPECTED[gpu][3])
    assert report["ipex_optimize"] == ("skipped",
                                       "intel-extension-for-pytorch is not installed")
    assert report["compile"] == ("skipped", "vetoed by plugin intel: no Triton with the "
                                            "Intel XPU backend")
    # The flag is set around the prepared model's calls only; the process keeps its own.
    assert fake.tf32 is False
    assert [c.name for c in result.process_settings] == (
        ["torch.backends.mkldnn.allow_tf32"] if TF32[gpu] else [])


def test_tf32_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    result = _optimize(monkeypatch, "Max 1550", nn.Linear(8, 8).eval(), "O2",
                       hardware={"intel": {"allow_tf32": False}})
    assert {p.name: p.detail for p in result.passes}["tf32"] == \
        "config hardware.intel.allow_tf32 is off"


def test_ipex_runs_only_when_it_matches_this_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.intel import IPEXUnavailableError

    model = nn.Sequential(nn.Linear(8, 8)).eval()
    report = {p.name: p.detail for p in _optimize(
        monkeypatch, "Arc B580", model, "O2", hardware={"intel": {"use_ipex": True}}).passes}
    assert report["ipex_optimize"] == "config hardware.intel.use_ipex=True, but " \
                                      "intel-extension-for-pytorch is not installed"
    with pytest.raises(IPEXUnavailableError, match="use_ipex=True, but"):
        _optimize(monkeypatch, "Arc B580", model, "O2", strict=True,
                  hardware={"intel": {"use_ipex": True}})
    report = {p.name: p.detail for p in _optimize(
        monkeypatch, "Arc B580", model, "O2", hardware={"intel": {"use_ipex": False}}).passes}
    assert report["ipex_optimize"] == "config hardware.intel.use_ipex is off"

    # A matching IPEX: its optimize() gets the eval model and the policy's dtype, and
    # returns an optimized copy (as ipex.optimize does, with weights prepacked).
    calls: list[tuple[nn.Module, torch.dtype]] = []
    fake_ipex = types.ModuleType("intel_extension_for_pytorch")
    fake_ipex.optimize = lambda m, dtype: (calls.append((m, dtype)), copy.deepcopy(m))[1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", fake_ipex)
    FakeXPUs(monkeypatch, "Arc B580")
    monkeypatch.setattr(probe, "ipex_status", lambda: IPEXStatus(True, "2.13.10+xpu", "ok"))
    cfg = torchbridge.TorchBridgeConfig.load(
        optimization={"disabled_passes": ["device_placement"]})
    result = torchbridge.get_backend("xpu", cfg).optimize(model, "O2")
    assert "ipex_optimize" in result.optimizations_applied
    assert [dtype for _, dtype in calls] == [torch.bfloat16] and not calls[0][0].training


def test_ipex_status_reads_metadata_and_compares_minor_versions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata

    installed: dict[str, str] = {}

    def version(name: str) -> str:
        if name in installed:
            return installed[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    status = probe.ipex_status()
    assert not status.usable and "not installed" in status.reason
    installed["intel-extension-for-pytorch"] = "2.8.10+xpu"
    monkeypatch.setattr(torch, "__version__", "2.13.0+xpu")
    status = probe.ipex_status()
    assert not status.usable and status.version == "2.8.10+xpu"
    assert "built for torch 2.8, this is torch 2.13.0+xpu" in status.reason
    monkeypatch.setattr(torch, "__version__", "2.8.0+xpu")
    assert probe.ipex_status().usable
    assert "intel_extension_for_pytorch" not in sys.modules  # never imported to find out


def test_triton_xpu_backend_is_found_on_disk(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: object) -> None:
    import importlib.util
    from pathlib import Path

    root = Path(str(tmp_path)) / "triton"
    (root / "backends" / "nvidia").mkdir(parents=True)
    spec = types.SimpleNamespace(submodule_search_locations=[str(root)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    ok, why = probe.triton_xpu_status()
    assert not ok and "no Intel XPU backend" in why
    (root / "backends" / "intel").mkdir()
    assert probe.triton_xpu_status()[0]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "not installed" in probe.triton_xpu_status()[1]


# -- distributed, memory, telemetry, device calls ----------------------------------------------
def test_distributed_backend_is_xccl_only_where_torch_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeXPUs(monkeypatch, "Max 1550")
    assert torchbridge.get_backend("xpu").distributed_backend == "xccl"
    fake.xccl = (False, "torch 2.7.1+xpu is built without XCCL")
    backend = torchbridge.get_backend("xpu")
    assert backend.distributed_backend is None  # not the "xccl" torch's table would claim
    info = backend.get_device_info()
    assert info.extra["distributed_backend_reason"] == "torch 2.7.1+xpu is built without XCCL"


def test_xccl_status_asks_this_torch() -> None:
    import torch.distributed as dist

    available, reason = probe.xccl_status()
    expected = bool(getattr(dist, "is_xccl_available", lambda: False)())
    assert available is expected and "XCCL" in reason


def test_memory_stats_and_device_calls_go_through_the_probe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeXPUs(monkeypatch, "Arc A770")
    backend = torchbridge.get_backend("xpu")
    stats = backend.get_memory_stats()
    assert (stats.allocated_bytes, stats.reserved_bytes, stats.peak_allocated_bytes) == \
        (GB, 2 * GB, 3 * GB)
    assert (stats.free_bytes, stats.total_bytes) == (fake.free, fake.props.total_memory)
    monkeypatch.setattr(probe, "mem_get_info", lambda i: None)  # torch without it
    stats = backend.get_memory_stats()
    assert stats.free_bytes is None and stats.total_bytes == fake.props.total_memory
    assert "free memory unknown" in stats.notes
    backend.synchronize()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    assert fake.calls == ["synchronize", "empty_cache", "reset_peak_memory_stats"]
    assert backend.answered_by["torchbridge_synchronize"] == "intel"


def test_max_memory_fraction_is_applied_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeXPUs(monkeypatch, "Max 1100", count=2)
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.xpu, "set_per_process_memory_fraction",
                        lambda f, d: calls.append((f, d)), raising=False)
    config = torchbridge.TorchBridgeConfig.load(hardware={"intel": {"max_memory_fraction": 0.7}})
    torchbridge.get_backend("xpu", config)
    assert calls == [(0.7, torch.device("xpu", 0)), (0.7, torch.device("xpu", 1))]


def test_intel_memory_manager_refuses_what_does_not_fit(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    from torchbridge.backends.intel import IntelMemoryManager, OutOfMemoryError

    fake = FakeXPUs(monkeypatch, "Arc 140V")
    fake.free = 100 * MiB
    # Nothing reserved and unused by this process's allocator, which would count as free.
    monkeypatch.setattr(probe, "allocator_counters", lambda i: (2 * GB, 2 * GB, 3 * GB))
    config = torchbridge.TorchBridgeConfig.load(hardware={"intel": {"pool_max_tensors": 3}})
    manager = IntelMemoryManager(config=config)
    assert manager.pool_max_tensors == 3
    with pytest.raises(OutOfMemoryError, match=r"free 100\.0 MiB") as info:
        manager.allocate_with_oom_protection((1024, 1024, 90), torch.uint8, safety_margin=1.2)
    assert isinstance(info.value, torch.OutOfMemoryError)


def test_telemetry_is_none_where_torch_or_the_driver_cannot_tell(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pyzes(device: object = None) -> float:
        raise ImportError("pyzes is required; install it with 'pip install pyzes'.")

    for name in probe.TELEMETRY.values():
        monkeypatch.setattr(torch.xpu, name, no_pyzes, raising=False)
    assert probe.telemetry(0) == dict.fromkeys(probe.TELEMETRY)
    monkeypatch.setattr(torch.xpu, "temperature", lambda device=None: 61.0, raising=False)
    monkeypatch.delattr(torch.xpu, "power_draw", raising=False)  # an older torch
    found = probe.telemetry(0)
    assert found["temperature_c"] == 61.0 and found["power_watts"] is None


def test_probe_reads_the_fields_this_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch 2.5-era properties object: no architecture, device_id or is_integrated_gpu,
    # and the 2024 development name of the bf16 flag.
    old = types.SimpleNamespace(name="Intel(R) Arc(TM) A770 Graphics", total_memory=16 * GB,
                                gpu_eu_count=512, has_fp16=1, has_fp64=0,
                                has_bf16_conversion=1, sub_group_sizes=[8, 16, 32])
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda i: old, raising=False)
    props = probe.device_properties(0)
    assert props.architecture is None and props.device_id is None
    assert props.is_integrated_gpu is None
    assert (props.has_fp16, props.has_fp64, props.has_bfloat16_conversions) == \
        (True, False, True)
    assert props.sub_group_sizes == (8, 16, 32)


# -- config, API, errors ---------------------------------------------------------------------
def test_intel_config_section_is_merged_and_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_HARDWARE__INTEL__USE_IPEX", "false")
    config = torchbridge.TorchBridgeConfig.load(hardware={"intel": {"allow_tf32": False}})
    assert config.hardware.intel.use_ipex is False
    assert config.hardware.intel.allow_tf32 is False
    assert config.hardware.intel.precision == "auto"
    with pytest.raises(torchbridge.ConfigurationError,
                       match=r"config key 'hardware\.intel\.max_memory_fraction' must be a "
                             r"number above 0 and at most 1, got 1\.5"):
        torchbridge.TorchBridgeConfig.load(hardware={"intel": {"max_memory_fraction": 1.5}})
    with pytest.raises(torchbridge.ConfigurationError, match=r"hardware\.intel\.precision"):
        torchbridge.TorchBridgeConfig.load(hardware={"intel": {"precision": "fp8"}})


def test_device_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.intel import XPUDeviceError, XPUDeviceManager

    FakeXPUs(monkeypatch, "Max 1550", count=4)
    monkeypatch.setattr(probe, "telemetry", lambda i: {"temperature_c": 48.0})
    manager = XPUDeviceManager()
    assert manager.device_count == 4 and manager.device_count() == 4
    props = manager.get_device_properties(3)
    assert (props["family"], props["ip_version"], props["has_fp64"]) == \
        ("ponte_vecchio", "12.60.7", True)
    assert manager.get_telemetry(0) == {"temperature_c": 48.0}
    with pytest.raises(XPUDeviceError, match=r"4 Intel GPU.*index 4 does not exist"):
        manager.get_device_properties(4)


def test_seed_api_and_backend_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.backends.intel import IntelBackend, IntelOptimizer

    FakeXPUs(monkeypatch, "Arc A770")
    backend = IntelBackend(optimization_level="O1")
    assert backend.config.optimization_level == "O1" and backend.name == "xpu"
    assert (backend.family, backend.supports_fp64) == ("alchemist", False)
    result = IntelOptimizer(backend=backend).optimize(nn.Linear(4, 4), "O0")
    assert isinstance(result, torchbridge.OptimizationResult)


def test_without_an_intel_gpu_the_api_says_so() -> None:
    from torchbridge.backends.intel import IntelBackend, XPUDeviceManager, XPUNotAvailableError

    reason = probe.probe().reason
    assert reason, "these tests expect a machine without an Intel GPU"
    for make in (IntelBackend, XPUDeviceManager):
        with pytest.raises(XPUNotAvailableError) as info:
            make()
        assert reason in str(info.value)
    assert issubclass(XPUNotAvailableError, torchbridge.BackendUnavailableError)


def test_exceptions_sit_under_the_core_hierarchy() -> None:
    from torchbridge.backends import intel

    assert issubclass(intel.OutOfMemoryError, torchbridge.OutOfMemoryError)
    assert issubclass(intel.UnsupportedDtypeError, torchbridge.ModelOptimizationError)
    assert issubclass(intel.IPEXUnavailableError, torchbridge.ConfigurationError)
    for name in ("XPUDeviceError", "XPUNotAvailableError", "OutOfMemoryError"):
        assert issubclass(getattr(intel, name), intel.IntelBackendError)


# -- real hardware -------------------------------------------------------------------------
@pytest.mark.xpu
def test_on_a_real_intel_gpu_description_memory_and_fp64() -> None:
    backend = torchbridge.get_backend("xpu")
    info = backend.get_device_info()
    props = torch.xpu.get_device_properties(0)
    assert ("float64" in info.supported_dtypes) is bool(getattr(props, "has_fp64", True))
    stats = backend.get_memory_stats()
    x = torch.empty(1024, 1024, device=backend.device)
    assert backend.get_memory_stats().allocated_bytes >= stats.allocated_bytes + x.nbytes
    backend.synchronize()
    model = nn.Linear(16, 16).double()
    if info.extra["fp64"] is False:
        with pytest.raises(torchbridge.UnsupportedDtypeError):
            backend.optimize(model, "O0")
    else:
        assert not backend.optimize(model, "O0").failed


@pytest.mark.xpu
def test_on_a_real_intel_gpu_o2_matches_eager() -> None:
    backend = torchbridge.get_backend("xpu")
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    result = backend.optimize(model, "O2", sample_input=x)
    assert result.max_rel_diff is not None and result.max_rel_diff < 3e-2
