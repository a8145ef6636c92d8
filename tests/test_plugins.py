"""The plugin mechanism end to end, through the example package's real entry points."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torchbridge
from hang_bounds import HANG_S
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
    assert backend.get_device_info().name == "Example Accelerator #0"
    assert backend.get_device_info().vendor == "Example Corp"


def test_device_hooks_get_the_backend_with_the_callers_config() -> None:
    """A plugin reads its own section through the `backend` argument: the config passed to
    get_backend, not one it loads itself."""
    config = torchbridge.TorchBridgeConfig(hardware={"example": {"greeting": "hej",
                                                                 "memory_gb": 2.0}})
    backend = torchbridge.get_backend("example", config=config)
    assert backend.hardware_config is config.hardware.example
    info = backend.get_device_info()
    assert info.extra["greeting"] == "hej" and info.memory_total_gb == 2.0
    assert backend.get_memory_stats().total_bytes == 2 * 1024**3
    assert torchbridge.get_backend("example").get_device_info().extra["greeting"] == "hello"


def test_only_the_owner_and_opted_in_fallbacks_answer(reload_plugins: None) -> None:
    """A backend that implements only torchbridge_detect on the CPU gets no host-CPU
    description unless it opts into the cpu fallback, and the answer says who gave it."""

    class Lean:
        def __init__(self, fallbacks: tuple[str, ...] | None) -> None:
            self.fallbacks = fallbacks

        @torchbridge.hookimpl
        def torchbridge_detect(self) -> torchbridge.Detection:
            return torchbridge.Detection("lean", True, -30, "cpu", 1, "Lean", "lean",
                                         fallbacks=self.fallbacks)

    torchbridge.register_plugin(Lean(()), name="lean")
    lean = torchbridge.get_backend("lean")
    with pytest.raises(torchbridge.DeviceError, match="no plugin answered "
                       "torchbridge_device_info for cpu:0 of backend 'lean'"):
        lean.get_device_info()
    with pytest.raises(torchbridge.DeviceError, match="torchbridge_synchronize"):
        lean.synchronize()
    assert "no plugin answered torchbridge_memory_stats" in (lean.get_memory_stats().notes or "")
    torchbridge.unregister_plugin("lean")

    torchbridge.register_plugin(Lean(("cpu",)), name="lean")
    lean = torchbridge.get_backend("lean")
    info = lean.get_device_info()
    assert lean.answered_by["torchbridge_device_info"] == "cpu (fallback)"
    assert "answered by the core's cpu fallback, not by plugin lean" in (info.notes or "")
    torchbridge.unregister_plugin("lean")

    with pytest.warns(DeprecationWarning, match="leans on the core's fallback answers"):
        torchbridge.register_plugin(Lean(None), name="lean")  # written before fallbacks
        lean = torchbridge.get_backend("lean")
    assert lean.get_device_info().name  # still works, as it did
    assert lean.answered_by["torchbridge_device_info"] == "cpu (fallback)"
    assert any("without opting in" in w for w in records()["lean"].warnings)


def test_plugins_written_against_the_first_hookspec_keep_working(reload_plugins: None
                                                                 ) -> None:
    """Implementations that name only (backend_name, device) still receive them."""

    class OldStyle:
        @torchbridge.hookimpl
        def torchbridge_detect(self) -> torchbridge.Detection:
            return torchbridge.Detection("oldstyle", True, -30, "cpu", 1, fallbacks=())

        @torchbridge.hookimpl
        def torchbridge_device_info(self, backend_name: str, device: torch.device
                                    ) -> torchbridge.DeviceInfo | None:
            if backend_name != "oldstyle":
                return None
            return torchbridge.DeviceInfo("Old", backend_name, None, None, None, ["float32"],
                                          device=str(device))

        @torchbridge.hookimpl
        def torchbridge_kernel(self, op: str, backend_name: str) -> object:
            if backend_name != "oldstyle":
                return None
            # the op's arguments; right, as get_kernel checks it against the reference
            return lambda gate, up: torch.nn.functional.silu(gate) * up

    torchbridge.register_plugin(OldStyle(), name="oldstyle")
    backend = torchbridge.get_backend("oldstyle")
    assert backend.get_device_info().name == "Old"
    kernel = torchbridge.get_kernel("silu_mul", backend)
    assert kernel.provider == "oldstyle"  # a plain callable: inference only, one opaque op
    ones = torch.ones(2)
    assert torch.equal(kernel(ones, ones), torch.nn.functional.silu(ones))


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
    assert hasattr(torchbridge.TorchBridgeConfig.load().hardware, "example")  # backend's
    assert torchbridge.get_kernel("rms_norm").implementation is None  # the reference

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


def test_the_builtin_cpu_backend_cannot_be_replaced(reload_plugins: None) -> None:
    class TwoCpus:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_detect(self) -> torchbridge.Detection:
            return torchbridge.Detection("cpu", False, 0, "cpu", 0, "Override", "replaced")

    torchbridge.register_plugin(TwoCpus(), name="two_cpus")
    cpu = next(s for s in torchbridge.list_backends() if s.name == "cpu")
    assert cpu.plugin == "cpu" and cpu.available
    assert "the cpu backend is built in" in (records()["two_cpus"].error or "")
    assert torchbridge.get_backend().name == "cpu"


def test_detection_returning_garbage_is_reported(reload_plugins: None) -> None:
    class Garbage:
        @torchbridge.hookimpl
        def torchbridge_detect(self) -> str:
            return "cuda is totally here"

    torchbridge.register_plugin(Garbage(), name="garbage")
    names = [s.name for s in torchbridge.list_backends()]
    assert "cpu" in names
    assert "returned str, expected torchbridge.Detection" in (records()["garbage"].error or "")


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


DECLARED_DEVICE_TYPE = """
import torchbridge
from torchbridge.devices import declare_device_type

class Npu:
    def __init__(self, declare):
        self.declare = declare

    @torchbridge.hookimpl
    def torchbridge_detect(self):
        if self.declare:
            declare_device_type("acmenpu")
        return torchbridge.Detection("acme", True, 50, "acmenpu", 1, "Acme", fallbacks=())

    @torchbridge.hookimpl
    def torchbridge_device_info(self, backend_name, device):
        if backend_name == "acme":  # selection asks before choosing it
            return torchbridge.DeviceInfo("Acme NPU", "acme", None, None, None, ["float32"])

    @torchbridge.hookimpl
    def torchbridge_memory_stats(self, backend_name, device):
        if backend_name == "acme":
            return torchbridge.MemoryStats(device=str(device))

torchbridge.register_plugin(Npu(False), name="undeclared")
status = {s.name: s for s in torchbridge.list_backends()}
print("undeclared offered:", "acme" in status and status["acme"].available)
print("error:", torchbridge.plugins.get_plugin_host().records["undeclared"].error)
torchbridge.unregister_plugin("undeclared")
torchbridge.register_plugin(Npu(True), name="declared")
status = {s.name: s for s in torchbridge.list_backends()}
print("declared offered:", status["acme"].available, status["acme"].device_type)
print("best:", torchbridge.detect_best_backend())
"""


def test_a_new_device_type_must_be_declared_through_torch() -> None:
    """PrivateUse1 can be renamed once per process, so this runs in its own."""
    out = subprocess.run([sys.executable, "-c", DECLARED_DEVICE_TYPE], capture_output=True,
                         text=True, timeout=HANG_S, check=True).stdout
    assert "undeclared offered: False" in out
    assert "device_type 'acmenpu' is not a torch device type; declare it first" in out
    assert "declared offered: True acmenpu" in out
    assert "best: acme" in out  # priority 50 beats cpu's 0


def test_pci_bus_id_from_device_properties() -> None:
    from types import SimpleNamespace

    from torchbridge.devices import pci_bus_id

    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    assert pci_bus_id(props) == "0000:3b:00.0"
    # torch before 2.6 has no PCI fields: the vendor library falls back to the index.
    assert pci_bus_id(SimpleNamespace(name="H100")) is None
