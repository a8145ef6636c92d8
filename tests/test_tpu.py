"""The TPU plugin's pieces that need no XLA runtime: config, version names, detection
outcomes at the probe seam. The real runtime is exercised in tests/xla (`nox -s tests_xla`)."""

from __future__ import annotations

import pytest
import torchbridge
from torchbridge_tpu import probe
from torchbridge_tpu.xla import tpu_version


def tpu_status() -> torchbridge.BackendStatus:
    return {s.name: s for s in torchbridge.list_backends(rescan=True)}["tpu"]


@pytest.mark.parametrize(("kind", "version"), [
    ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5p", "v5p"), ("TPU v6 lite", "v6e"),
    ("TPU v7", "v7"), ("TPU v3", "v3"), ("CPU", None), ("TPU", None)])
def test_tpu_version_from_device_kind(kind: str, version: str | None) -> None:
    assert tpu_version(kind) == version


def test_tpu_config_section_validates_and_takes_the_seeds_names() -> None:
    config = torchbridge.TorchBridgeConfig.load(hardware={"tpu": {
        "version": "v5e", "topology": "pod", "compilation_mode": "torch_xla",
        "memory_fraction": 0.9, "precision": "float32"}})
    tpu = config.hardware.tpu
    assert (tpu.version.value, tpu.topology.value) == ("v5e", "pod")
    assert tpu.compilation_mode == "lazy" and tpu.memory_fraction == 0.9
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
    monkeypatch.setattr(probe, "probe", lambda: probe.XlaIndication(True, "TPU",
                                                                    "PJRT_DEVICE=TPU", True))
    monkeypatch.setattr(probe, "xla_runtime", lambda: probe.XlaRuntime("TPU", 4, 1, []))
    assert tpu_status().available and tpu_status().device_count == 4
    assert torchbridge.detect_best_backend() == "tpu"
    monkeypatch.setattr(probe, "xla_runtime", lambda: probe.XlaRuntime("CPU", 1, 1, []))
    assert tpu_status().available and tpu_status().priority < 0
    assert torchbridge.detect_best_backend() == "cpu"
