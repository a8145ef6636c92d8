"""The TPU plugin's pieces that need no XLA runtime: config, version names, per-generation
dtypes, detection outcomes at the probe seam. The real runtime is exercised in tests/xla
(`nox -s tests_xla`)."""

from __future__ import annotations

from typing import Any

import pytest
import torchbridge
from torchbridge_tpu import probe
from torchbridge_tpu.xla import tpu_version

GiB = 1024**3
# One device per TPU generation as the XLA runtime describes it: the "device_kind" device
# attribute (the PJRT kinds JAX maps in jax/_src/pallas/mosaic/tpu_info.py) and the HBM one
# runtime device holds (Cloud TPU system-architecture pages; per TensorCore where a chip shows
# as two devices). Written by hand from these public specifications, not captured from a real
# device. (device kind, HBM GiB per device, expected version, expected dtypes)
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


class FakeTPU:
    """The probe seam answering like a host of `count` devices of one recorded generation
    (XlaRuntime("TPU", ...)), `world_size` processes, with memory figures."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tpu: str, count: int = 4,
                 world_size: int = 1, kind: str | None = None,
                 attributes: list[dict[str, Any]] | None = None) -> None:
        recorded_kind, hbm_gib, _, _ = RECORDED[tpu]
        self.kind = kind or recorded_kind
        self.attributes = attributes or [
            {"device_kind": self.kind, "coords": [i % 2, i // 2, 0], "core_on_chip": 0}
            for i in range(count)]
        runtime = probe.XlaRuntime("TPU", count, world_size, self.attributes)
        monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(
            True, "TPU", "PJRT_DEVICE=TPU", True))
        monkeypatch.setattr(probe, "xla_runtime", lambda: runtime)
        monkeypatch.setattr(probe, "memory_info", lambda device: {
            "used": GiB, "limit": hbm_gib * GiB, "peak": 2 * GiB})
        torchbridge.list_backends(rescan=True)


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
        "CPU", 1, 1, [{"device_kind": "cpu"}]))
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
    assert info.notes == ("hardware.tpu.topology=pod, but the runtime reports single (world "
                          "size 1, 4 addressable device(s)); using what the runtime reports")
    assert describe(topology="single").notes is None
    assert describe().extra["topology"] == "single"  # auto: no expectation, no note

    FakeTPU(monkeypatch, "v5p-8", world_size=4)  # one slice over four hosts
    assert describe(topology="pod").notes is None
    assert describe().extra["topology"] == "pod"

    two_slices = [{"device_kind": "TPU v4", "slice_index": i // 2, "core_on_chip": 0}
                  for i in range(4)]  # Multislice: torch_xla's "slice_index" attribute
    FakeTPU(monkeypatch, "v4-8", world_size=2, attributes=two_slices)
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
