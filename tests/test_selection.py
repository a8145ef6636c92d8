"""Discovery and selection through recorded device properties at each plugin's probe seam."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
import torchbridge
from torchbridge import BackendUnavailableError


def statuses() -> dict[str, torchbridge.BackendStatus]:
    return {s.name: s for s in torchbridge.list_backends()}


def test_this_machine_selects_cpu_with_reasons_for_the_rest() -> None:
    found = statuses()
    assert torchbridge.detect_best_backend() == "cpu"
    assert [s.name for s in torchbridge.list_backends()][:5] == ["cuda", "rocm", "xpu", "tpu",
                                                                 "cpu"]
    for name in ("cuda", "rocm", "xpu", "tpu"):
        assert not found[name].available
        assert found[name].reason
    assert found["cpu"].available and found["cpu"].device_count == 1


def test_asking_for_an_unavailable_backend_says_why(no_cuda_reason: str) -> None:
    with pytest.raises(BackendUnavailableError) as info:
        torchbridge.get_backend("cuda")
    assert no_cuda_reason in str(info.value)
    assert info.value.backend == "cuda"
    with pytest.raises(BackendUnavailableError, match="unknown backend 'quantum'"):
        torchbridge.get_backend("quantum")


def test_missing_plugin_names_the_package_to_install(monkeypatch: pytest.MonkeyPatch,
                                                     reload_plugins: None) -> None:
    from importlib import metadata

    real = metadata.entry_points

    def without_nvidia(**kw: str) -> list[metadata.EntryPoint]:
        return [ep for ep in real(**kw) if ep.name != "nvidia"]

    monkeypatch.setattr(metadata, "entry_points", without_nvidia)
    torchbridge.reload_plugins()
    with pytest.raises(BackendUnavailableError, match=r"pip install torchbridge\[nvidia\]"):
        torchbridge.get_backend("nvidia")  # vendor alias of cuda
    for module in ("torchbridge_nvidia", "torchbridge_nvidia.api"):  # as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.delitem(sys.modules, "torchbridge.backends.nvidia", raising=False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install torchbridge\[nvidia\]"):
        importlib.import_module("torchbridge.backends.nvidia")


def test_backend_override_by_env_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "example")
    assert torchbridge.detect_best_backend() == "example"
    assert torchbridge.get_backend().name == "example"
    cfg = torchbridge.TorchBridgeConfig(backend="cpu")
    assert torchbridge.get_backend(config=cfg).name == "cpu"
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError):
        torchbridge.get_backend()


@pytest.mark.parametrize("value", ["cuda", "rocm", "cdua", "cpu:x"])
def test_detect_best_backend_checks_the_variable_as_get_backend_does(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # It returned the variable as it stood: "rocm" on a machine without one, "cdua", and
    # "cpu:x", where get_backend() raised.
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", value)
    with pytest.raises(torchbridge.TorchBridgeError) as raised:
        torchbridge.get_backend()
    with pytest.raises(type(raised.value), match=str(raised.value)[:20]):
        torchbridge.detect_best_backend()


def test_detect_best_backend_names_the_backend_an_alias_or_index_picks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", " CPU ")
    assert torchbridge.detect_best_backend() == "cpu"
    monkeypatch.setenv("TORCHBRIDGE_BACKEND", "cpu:0")
    assert torchbridge.detect_best_backend() == "cpu:0"
    assert torchbridge.get_backend(torchbridge.detect_best_backend()).name == "cpu"


# Recorded from real machines: (torch.version.cuda, torch.version.hip, is_available, count).
H100_NODE = ("12.4", None, True, 8)
MI300X_NODE = (None, "6.2.41133", True, 8)


def fake_torch_runtime(monkeypatch: pytest.MonkeyPatch, cuda: str | None, hip: str | None,
                       available: bool, count: int, *, answered: bool = True) -> None:
    """Detection as on that machine. Only detection: its device hooks have nothing to answer
    with, so selection's health check is told they answered, unless `answered` is False
    (see test_health_check_*)."""
    if answered:
        monkeypatch.setattr("torchbridge.selection.health_problem", lambda status: None)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    torchbridge.list_backends(rescan=True)


def test_nvidia_node_selects_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_runtime(monkeypatch, *H100_NODE)
    found = statuses()
    assert found["cuda"].available and found["cuda"].device_count == 8
    assert not found["rocm"].available  # a CUDA build is never AMD's
    assert torchbridge.detect_best_backend() == "cuda"


def test_rocm_build_is_amd_never_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_runtime(monkeypatch, *MI300X_NODE)
    found = statuses()
    assert not found["cuda"].available
    assert "ROCm build" in (found["cuda"].reason or "")
    assert found["rocm"].available and found["rocm"].device_type == "cuda"
    assert torchbridge.detect_best_backend() == "rocm"


def test_cuda_build_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_torch_runtime(monkeypatch, "12.4", None, False, 0)
    assert "no NVIDIA GPU visible" in (statuses()["cuda"].reason or "")


def test_xpu_detected_below_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchbridge_intel.probe as intel
    from torchbridge import devices

    monkeypatch.setattr(intel, "probe", lambda: torchbridge.types.ProbeResult(True, 2, None))
    monkeypatch.setattr("torchbridge.selection.health_problem", lambda status: None)
    real_count = devices.runtime_device_count
    monkeypatch.setattr(devices, "runtime_device_count",  # torch sees the two XPUs
                        lambda kind: 2 if kind == "xpu" else real_count(kind))
    torchbridge.list_backends(rescan=True)
    assert torchbridge.detect_best_backend() == "xpu"
    fake_torch_runtime(monkeypatch, *H100_NODE)
    assert torchbridge.detect_best_backend() == "cuda"


def test_tpu_probe_never_imports_torch_xla_when_not_indicated() -> None:
    code = ("import sys, torchbridge; s = {b.name: b for b in torchbridge.list_backends()}; "
            "print('torch_xla' in sys.modules, s['tpu'].available, s['tpu'].reason)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PATH": "", "HOME": "/tmp"}).stdout
    assert out.startswith("False False no TPU indicated")


def test_tpu_indicated_without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name == "torch_xla" else real_find_spec(name, *a))
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    torchbridge.list_backends(rescan=True)
    reason = statuses()["tpu"].reason or ""
    assert "PJRT_DEVICE=TPU" in reason and "torch_xla is not installed" in reason


def test_health_check_passes_over_a_detection_whose_device_hooks_fail(
        monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    """The H100 node's detection without its device properties: cuda is detected, but its
    device hooks cannot describe device 0, so selection passes it over for cpu and says why.
    (The nvidia plugin's failed hooks are recorded as its errors: reload_plugins clears
    them for the tests after this one.)"""
    fake_torch_runtime(monkeypatch, *H100_NODE, answered=False)
    assert statuses()["cuda"].available and statuses()["cuda"].health is None  # not asked yet
    assert torchbridge.detect_best_backend() == "cpu"
    assert torchbridge.get_backend().name == "cpu"
    cuda = statuses()["cuda"]
    assert cuda.available and cuda.health is not None
    assert cuda.health.startswith("its device hooks failed: DeviceError: no plugin answered "
                                  "torchbridge_device_info for cuda:0 of backend 'cuda'")
    assert statuses()["cpu"].health is None  # the last resort is not asked
    torchbridge.list_backends(rescan=True)  # a rescan asks again
    assert statuses()["cuda"].health is None
