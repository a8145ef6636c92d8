"""The TPU plugin's pieces that need no XLA runtime: config, version names, per-generation
dtypes, detection outcomes at the probe seam. The real runtime is exercised in tests/xla
(`nox -s tests_xla`)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torchbridge
from torchbridge_tpu import probe
from torchbridge_tpu.xla import tpu_version

GiB = 1024**3
# One device per TPU generation as the XLA runtime describes it: its PJRT device kind, which
# torch_xla returns from xm.xla_device_kind() (the kinds JAX maps in
# jax/_src/pallas/mosaic/tpu_info.py), and the HBM one runtime device holds (Cloud TPU
# system-architecture pages; per TensorCore where a chip shows as two devices). Written by
# hand from these public specifications, not captured from a real device. (device kind, HBM
# GiB per device, expected version, expected dtypes)
BF16 = ["float32", "bfloat16"]
RECORDED = {
    "v2-8": ("TPU v2", 8, "v2", BF16),
    "v3-8": ("TPU v3", 16, "v3", BF16),
    "v4-8": ("TPU v4", 32, "v4", BF16),  # int8 only at the bf16 rate: not listed
    "v5litepod-8": ("TPU v5 lite", 16, "v5e", [*BF16, "int8"]),
    "v5p-8": ("TPU v5", 95, "v5p", [*BF16, "int8"]),
    "v6e-8": ("TPU v6 lite", 32, "v6e", [*BF16, "int8"]),
    "tpu7x-8": ("TPU7x", 96, "v7x", [*BF16, "float8_e4m3fn", "float8_e5m2"]),
}


def tpu_status() -> torchbridge.BackendStatus:
    return {s.name: s for s in torchbridge.list_backends(rescan=True)}["tpu"]


def tpu_attributes(count: int) -> list[dict[str, Any]]:
    """xr.global_runtime_device_attributes() of `count` TPU chips, as torch_xla's SPMD guide
    prints them for a v4-8: no device kind among them."""
    return [{"core_on_chip": 0, "num_cores": 1, "coords": [i % 2, i // 2, 0],
             "name": f"TPU:{i}"} for i in range(count)]


class FakeTPU:
    """The probe seam answering like `hosts` hosts of `count` devices of one recorded
    generation (XlaRuntime("TPU", ...)), torch_xla's `world_size`, with memory figures. The
    kind comes apart from the attributes, as torch_xla reports it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tpu: str, count: int = 4,
                 world_size: int = 1, kind: str | None = None,
                 attributes: list[dict[str, Any]] | None = None, hosts: int = 1) -> None:
        recorded_kind, hbm_gib, _, _ = RECORDED[tpu]
        self.kind = kind or recorded_kind
        self.attributes = attributes or tpu_attributes(count)
        runtime = probe.XlaRuntime("TPU", count, world_size, self.attributes, self.kind, hosts)
        monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(
            True, "TPU", "PJRT_DEVICE=TPU", True))
        monkeypatch.setattr(probe, "xla_runtime", lambda: runtime)
        monkeypatch.setattr(probe, "memory_info", lambda device: {
            "used": GiB, "limit": hbm_gib * GiB, "peak": 2 * GiB})
        torchbridge.list_backends(rescan=True)


@pytest.fixture
def fresh_runtime() -> Iterator[None]:
    """probe.xla_runtime() asked anew: it caches the runtime's answers for the process."""
    probe.xla_runtime.cache_clear()
    yield
    probe.xla_runtime.cache_clear()


def record_torch_xla(monkeypatch: pytest.MonkeyPatch, *, hw: str, kind: str,
                     attributes: list[dict[str, Any]], devices: int, world_size: int,
                     processes: int, local_processes: int) -> None:
    """torch_xla as probe.xla_runtime() reads it, answering what torch_xla 2.9's functions
    return on one process of a TPU job (values written by hand): xm.xla_device_hw ("TPU"),
    xm.xla_device_kind (the PJRT kind: "TPU v5 lite"), xr.global_runtime_device_attributes
    (every device's PJRT attributes, without the kind), xr.world_size (under xmp.spawn, the
    global device count), xr.process_count (processes of the job) and
    xr.local_process_count (processes on this host)."""
    xla, core = types.ModuleType("torch_xla"), types.ModuleType("torch_xla.core")
    xm, xr = types.ModuleType("torch_xla.core.xla_model"), types.ModuleType("torch_xla.runtime")
    xla.device = lambda: "xla:0"  # type: ignore[attr-defined]
    xm.xla_device_hw = lambda device: hw  # type: ignore[attr-defined]
    xm.xla_device_kind = lambda device=None: kind  # type: ignore[attr-defined]
    xr.global_runtime_device_attributes = lambda: attributes  # type: ignore[attr-defined]
    xr.addressable_runtime_device_count = lambda: devices  # type: ignore[attr-defined]
    xr.world_size = lambda: world_size  # type: ignore[attr-defined]
    xr.process_count = lambda: processes  # type: ignore[attr-defined]
    xr.local_process_count = lambda: local_processes  # type: ignore[attr-defined]
    xla.core, core.xla_model, xla.runtime = core, xm, xr  # type: ignore[attr-defined]
    for module in (xla, core, xm, xr):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(True, "TPU",
                                                                    "PJRT_DEVICE=TPU", True))
    monkeypatch.setattr(probe, "memory_info", lambda device: {
        "used": GiB, "limit": 16 * GiB, "peak": 2 * GiB})


def describe(**tpu_config: Any) -> torchbridge.DeviceInfo:
    config = torchbridge.TorchBridgeConfig.load(hardware={"tpu": tpu_config})
    return torchbridge.get_backend("tpu", config).get_device_info()


@pytest.mark.parametrize(("kind", "version"), [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"),
    ("TPU v7", "v7"), ("TPU v3", "v3"), ("CPU", None), ("TPU", None),
    ("TPU7x", "v7x"), ("TPU7", "v7"), ("TPU v5", "v5p"), ("TPU v4 lite", "v4"),
    ("TPU v5e", "v5e"), ("TPU v6e", "v6e"), ("TPU v2", "v2")])
def test_tpu_version_from_device_kind(kind: str, version: str | None) -> None:
    assert tpu_version(kind) == version


@pytest.mark.parametrize("tpu", list(RECORDED))
def test_each_generation_gets_its_own_dtypes(monkeypatch: pytest.MonkeyPatch, tpu: str
                                             ) -> None:
    FakeTPU(monkeypatch, tpu)
    kind, hbm_gib, version, dtypes = RECORDED[tpu]
    info = describe()
    assert (info.name, info.vendor, info.architecture) == (kind, "Google", version)
    assert info.compute_capability == version and info.extra["tpu_version"] == version
    assert info.supported_dtypes == dtypes
    assert "float16" not in info.supported_dtypes  # not a TPU matmul type
    assert info.preferred_low_precision_dtype == "bfloat16"
    assert info.memory_total_gb == hbm_gib and info.notes is None
    assert info.extra["topology"] == "single"


def test_ironwood_tpu7x_is_recognised_with_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    # Cloud TPU "TPU7x (Ironwood)": FP8 4614 TFLOPs, twice its bf16 2307; no int8 figure.
    FakeTPU(monkeypatch, "tpu7x-8")
    info = describe()
    assert info.architecture == "v7x" and info.extra["generation"] == "TPU7x (Ironwood)"
    assert {"float8_e4m3fn", "float8_e5m2"} <= set(info.supported_dtypes)
    assert "int8" not in info.supported_dtypes


def test_the_generation_comes_from_torch_xlas_device_kind_not_the_attributes(
        monkeypatch: pytest.MonkeyPatch, fresh_runtime: None) -> None:
    # A v5litepod-8 under xmp.spawn: a process per chip, each addressing one device, and
    # the device attributes hold no kind (torch_xla's SPMD guide, a v4-8's).
    record_torch_xla(monkeypatch, hw="TPU", kind="TPU v5 lite", attributes=tpu_attributes(8),
                     devices=1, world_size=8, processes=8, local_processes=8)
    info = describe()
    assert (info.name, info.architecture, info.compute_capability) == \
        ("TPU v5 lite", "v5e", "v5e")
    assert info.supported_dtypes == [*BF16, "int8"]
    assert info.extra["pjrt_device_kind"] == "TPU v5 lite"
    # one host, however many processes and devices torch_xla's world size counts
    assert (info.extra["topology"], info.extra["host_count"], info.extra["world_size"]) == \
        ("single", 1, 8)


def test_a_slice_over_hosts_is_a_pod_from_torch_xlas_process_counts(
        monkeypatch: pytest.MonkeyPatch, fresh_runtime: None) -> None:
    # A v5p-32 run as SPMD: one process per host, four hosts of four chips.
    record_torch_xla(monkeypatch, hw="TPU", kind="TPU v5", attributes=tpu_attributes(16),
                     devices=4, world_size=1, processes=4, local_processes=1)
    info = describe(topology="pod")
    assert info.extra["topology"] == "pod" and info.notes is None
    assert info.extra["host_count"] == 4 and info.architecture == "v5p"


def test_a_device_kind_among_the_attributes_is_still_read(
        monkeypatch: pytest.MonkeyPatch, fresh_runtime: None) -> None:
    # A runtime whose attributes do carry the kind: that is the device's own answer.
    attributes = [{**a, "device_kind": "TPU v4"} for a in tpu_attributes(4)]
    record_torch_xla(monkeypatch, hw="TPU", kind="TPU v4", attributes=attributes, devices=4,
                     world_size=1, processes=1, local_processes=1)
    assert describe().architecture == "v4"


def test_configured_version_fills_in_only_for_an_unknown_tpu(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    FakeTPU(monkeypatch, "tpu7x-8", kind="TPU v9")  # a kind no table knows
    with caplog.at_level("WARNING", logger="torchbridge_tpu.xla"):
        info = describe()
    assert info.architecture == "unknown" and info.compute_capability == "v9"
    assert info.supported_dtypes == BF16  # only what every TPU has
    assert "not in this plugin's TPU table" in caplog.text
    info = describe(version="v7x")
    assert info.architecture == "v7x" and "float8_e4m3fn" in info.supported_dtypes
    assert "TPU v9 is not in this plugin's TPU table; treated as v7x" in (info.notes or "")

    FakeTPU(monkeypatch, "v6e-8")  # known: the device kind wins over the setting
    info = describe(version="v5e")
    assert info.architecture == "v6e" and info.supported_dtypes == [*BF16, "int8"]
    assert info.notes == "hardware.tpu.version=v5e ignored: the device is v6e (TPU v6 lite)"
    assert describe(version="v6e").notes is None


def test_configured_version_on_xla_cpu_is_noted_not_applied(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(True, "CPU",
                                                                    "PJRT_DEVICE=CPU", True))
    monkeypatch.setattr(probe, "xla_runtime", lambda: probe.XlaRuntime(
        "CPU", 1, 1, [{"name": "CPU:0"}], "cpu"))  # what XLA:CPU reports
    monkeypatch.setattr(probe, "memory_info", lambda device: None)
    torchbridge.list_backends(rescan=True)
    info = describe(version="v5p")
    assert info.architecture == "xla-cpu" and info.extra["tpu_version"] is None
    assert info.notes == "hardware.tpu.version=v5p ignored: no TPU here (XLA on CPU)"
    assert "bfloat16" in info.supported_dtypes  # the stand-in keeps the TPU's code paths


def test_topology_is_reported_and_checked_against_the_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    FakeTPU(monkeypatch, "v5p-8", world_size=1)
    info = describe(topology="pod")
    assert info.extra["topology"] == "single"
    assert info.notes == ("hardware.tpu.topology=pod, but the runtime reports single (1 "
                          "host(s), world size 1, 4 addressable device(s)); using what the "
                          "runtime reports")
    assert describe(topology="single").notes is None
    assert describe().extra["topology"] == "single"  # auto: no expectation, no note

    # xmp.spawn on one host: a process per chip, and torch_xla's world size counts devices
    FakeTPU(monkeypatch, "v5p-8", count=1, world_size=4, hosts=1)
    assert describe().extra["topology"] == "single"
    assert describe(topology="single").notes is None

    FakeTPU(monkeypatch, "v5p-8", world_size=1, hosts=4)  # one slice over four hosts
    assert describe(topology="pod").notes is None
    assert describe().extra["topology"] == "pod" and describe().extra["host_count"] == 4

    two_slices = [{**a, "slice_index": i // 2} for i, a in enumerate(tpu_attributes(4))]
    FakeTPU(monkeypatch, "v4-8", world_size=2, attributes=two_slices, hosts=2)  # Multislice
    assert describe(topology="superpod").extra["topology"] == "superpod"
    assert "reports superpod" in (describe(topology="pod").notes or "")


def test_tpu_versions_in_config_and_table_agree() -> None:
    from torchbridge.backends.tpu import GENERATIONS, TPUTopology, TPUVersion

    assert {v.value for v in TPUVersion} - {"auto"} == set(GENERATIONS)
    assert [t.value for t in TPUTopology] == ["auto", "single", "pod", "superpod"]
    config = torchbridge.TorchBridgeConfig.load()
    assert (config.hardware.tpu.version.value, config.hardware.tpu.topology.value) == \
        ("auto", "auto")


def test_tpu_config_section_validates_and_takes_the_seeds_names() -> None:
    config = torchbridge.TorchBridgeConfig.load(hardware={"tpu": {
        "version": "v5e", "topology": "pod", "compilation_mode": "torch_xla",
        "memory_fraction": 0.9, "precision": "float32"}})
    tpu = config.hardware.tpu
    assert (tpu.version.value, tpu.topology.value) == ("v5e", "pod")
    assert tpu.compilation_mode == "lazy" and tpu.memory_fraction == 0.9
    assert torchbridge.TorchBridgeConfig.load(
        hardware={"tpu": {"version": "v7x"}}).hardware.tpu.version.value == "v7x"
    for bad in ({"version": "v1"}, {"memory_fraction": 1.5}, {"precision": "int8"},
                {"topology": "galaxy"}):
        with pytest.raises(torchbridge.ConfigurationError, match=r"hardware\.tpu\."):
            torchbridge.TorchBridgeConfig.load(hardware={"tpu": bad})


def test_indicated_but_runtime_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(True, "TPU",
                                                                    "PJRT_DEVICE=TPU", True))

    def refuse() -> probe.XlaRuntime:
        raise RuntimeError("TPU initialization failed: No TPU devices found")

    monkeypatch.setattr(probe, "xla_runtime", refuse)
    status = tpu_status()
    assert not status.available
    assert "the XLA runtime did not start: RuntimeError: TPU initialization failed" in \
        (status.reason or "")


def test_a_tpu_ranks_above_cpu_and_xla_on_cpu_below(monkeypatch: pytest.MonkeyPatch) -> None:
    # A recorded TPU cannot answer its device hooks here: selection's health check is the
    # contract suite's business, not this ranking's.
    monkeypatch.setattr("torchbridge.selection.health_problem", lambda status: None)
    monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(True, "TPU",
                                                                    "PJRT_DEVICE=TPU", True))
    monkeypatch.setattr(probe, "xla_runtime", lambda: probe.XlaRuntime("TPU", 4, 1, []))
    assert tpu_status().available and tpu_status().device_count == 4
    assert torchbridge.detect_best_backend() == "tpu"
    monkeypatch.setattr(probe, "xla_runtime", lambda: probe.XlaRuntime("CPU", 1, 1, []))
    assert tpu_status().available and tpu_status().priority < 0
    assert torchbridge.detect_best_backend() == "cpu"
