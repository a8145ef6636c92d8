"""The plugin mechanism end to end, through the example package's real entry points."""

from __future__ import annotations

import pytest
import torch
import torchbridge
from torchbridge.plugins import plugin_records


def records() -> dict[str, torchbridge.plugins.PluginRecord]:
    torchbridge.list_backends()  # discovery runs the isolated hooks
    return {r.name: r for r in plugin_records()}


def test_third_party_plugins_are_discovered() -> None:
    found = records()
    assert found["example"].status == "loaded"
    assert found["example"].distribution == "torchbridge-example-plugin"
    assert found["example"].group == "torchbridge.plugins"
    for vendor in ("nvidia", "amd", "intel", "tpu"):
        assert found[vendor].status == "loaded", found[vendor]
    assert found["cpu"].status == "builtin"


def test_third_party_backend_is_selectable_by_name_only() -> None:
    assert torchbridge.detect_best_backend() == "cpu"  # priority -5 loses to cpu's 0
    backend = torchbridge.get_backend("example")
    assert backend.get_device_info().name == "Example Accelerator"
    assert backend.get_device_info().vendor == "Example Corp"


def test_broken_plugins_are_reported_and_the_host_keeps_working() -> None:
    found = records()
    assert found["broken_import"].status == "failed"
    assert "ImportError: broken_import" in (found["broken_import"].error or "")
    assert found["broken_detect"].status == "error"
    assert "torchbridge_detect" in (found["broken_detect"].error or "")
    backend = torchbridge.get_backend()
    assert backend.name == "cpu"
    assert torch.equal(backend.to_device(torch.ones(2)), torch.ones(2))


def test_block_list_and_allow_list(monkeypatch: pytest.MonkeyPatch, reload_plugins: None) -> None:
    monkeypatch.setenv("TORCHBRIDGE_DISABLE_PLUGINS", "example, broken_import")
    torchbridge.reload_plugins()
    found = records()
    assert found["example"].status == "disabled"
    assert "TORCHBRIDGE_DISABLE_PLUGINS" in (found["example"].error or "")
    assert not hasattr(torchbridge.TorchBridgeConfig.load().hardware, "example")
    assert torchbridge.get_kernel("rms_norm").__module__ == "torchbridge.kernels"

    monkeypatch.delenv("TORCHBRIDGE_DISABLE_PLUGINS")
    monkeypatch.setenv("TORCHBRIDGE_PLUGINS", "nvidia")
    torchbridge.reload_plugins()
    found = records()
    assert found["nvidia"].status == "loaded"
    assert {found[n].status for n in ("amd", "intel", "tpu", "example")} == {"disabled"}
    status = {s.name: s for s in torchbridge.list_backends()}
    assert "disabled by TORCHBRIDGE_PLUGINS" in (status["rocm"].reason or "")
    # built-ins cannot be disabled: there is always a CPU backend
    assert torchbridge.get_backend().name == "cpu"


def test_tryfirst_plugin_overrides_a_builtin_hook(reload_plugins: None) -> None:
    class FasterCPUInfo:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_device_info(self, backend_name: str, device: torch.device
                                    ) -> torchbridge.DeviceInfo | None:
            if backend_name != "cpu":
                return None
            return torchbridge.DeviceInfo("Overridden CPU", "cpu", 1.0, 1.0, None, ["float32"])

    torchbridge.register_plugin(FasterCPUInfo(), name="override_cpu_info")
    assert torchbridge.get_backend("cpu").get_device_info().name == "Overridden CPU"
    torchbridge.unregister_plugin("override_cpu_info")
    assert torchbridge.get_backend("cpu").get_device_info().name != "Overridden CPU"


def test_plugin_detection_overrides_builtin_for_same_name(reload_plugins: None) -> None:
    class TwoCpus:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_detect(self) -> torchbridge.Detection:
            return torchbridge.Detection("cpu", True, 0, "cpu", 1, "Override", "replaced")

    torchbridge.register_plugin(TwoCpus(), name="two_cpus")
    cpu = next(s for s in torchbridge.list_backends() if s.name == "cpu")
    assert cpu.plugin == "two_cpus" and cpu.vendor == "Override"


def test_detection_returning_garbage_is_reported(reload_plugins: None) -> None:
    class Garbage:
        @torchbridge.hookimpl
        def torchbridge_detect(self) -> str:
            return "cuda is totally here"

    torchbridge.register_plugin(Garbage(), name="garbage")
    names = [s.name for s in torchbridge.list_backends()]
    assert "cpu" in names
    assert "expected torchbridge.types.Detection" in (records()["garbage"].error or "")


def test_loading_is_thread_safe_and_happens_once(reload_plugins: None) -> None:
    import threading

    from torchbridge import plugins

    plugins._host = None
    hosts = []
    threads = [threading.Thread(target=lambda: hosts.append(plugins.get_plugin_host()))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(h) for h in hosts}) == 1
