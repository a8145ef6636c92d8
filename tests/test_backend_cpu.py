"""The CPU backend honours the contract every backend must honour."""

from __future__ import annotations

import pytest
import torch
import torchbridge
from torchbridge.backends import BackendFactory, CPUBackend, detect_best_backend
from torchbridge.testing import BackendContract


class TestCPUBackendContract(BackendContract):
    backend_name = "cpu"


def test_seed_snippets_work() -> None:
    backend = BackendFactory.create(detect_best_backend())
    assert backend.name == "cpu"
    info = backend.get_device_info()
    assert f"{info.memory_total_gb:.1f}"
    stats = backend.get_memory_stats()
    assert stats["allocated"] is None  # the CPU allocator keeps no counter: unknown, not 0
    assert stats["free"] > 0
    backend.empty_cache()
    cpu = CPUBackend(optimization_level="O1")
    assert cpu.config.optimization_level == "O1"
    model = cpu.prepare_model(torch.nn.Linear(4, 4))
    assert torchbridge.optimization_result(model).level == "O1"


def test_cpu_info_reads_capabilities(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge import cpu

    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2"}))
    info = torchbridge.get_backend("cpu").get_device_info()
    assert info.preferred_low_precision_dtype is None  # no native bf16: stay in float32
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    info = torchbridge.get_backend("cpu").get_device_info()
    assert info.preferred_low_precision_dtype == "bfloat16"


def test_precision_config_overrides_device_preference() -> None:
    backend = torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(precision="fp32"))
    assert backend.low_precision_dtype() is None
    a = torch.randn(4, 4)
    with backend.autocast():
        assert (a @ a).dtype == torch.float32


def test_num_threads_config_is_applied() -> None:
    before = torch.get_num_threads()
    try:
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(
            hardware={"cpu": {"num_threads": 1}}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_device_index_parsing() -> None:
    with pytest.raises(torchbridge.DeviceError, match="index 3 does not exist"):
        torchbridge.get_backend("cpu:3")
    with pytest.raises(torchbridge.DeviceError, match="bad device index"):
        torchbridge.get_backend("cpu:x")
    with pytest.raises(torchbridge.DeviceError, match="in backend name cpu:x"):
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(backend="cpu:x"))


def test_device_hooks_answer_for_cpu() -> None:
    """torchbridge_synchronize, torchbridge_empty_cache, torchbridge_reset_peak_memory_stats,
    torchbridge_memory_stats and torchbridge_distributed_backend answer for the CPU."""
    backend = torchbridge.get_backend("cpu")
    hook = torchbridge.plugins.get_plugin_host().hook
    dev = torch.device("cpu")
    assert hook.torchbridge_synchronize(backend_name="cpu", device=dev) is True
    assert hook.torchbridge_empty_cache(backend_name="cpu", device=dev) is True
    assert hook.torchbridge_reset_peak_memory_stats(backend_name="cpu", device=dev) is True
    assert hook.torchbridge_memory_stats(backend_name="cpu", device=dev).total_bytes > 0
    assert hook.torchbridge_distributed_backend(backend_name="cpu", device=dev) == "gloo"
    assert backend.distributed_backend == "gloo"


def test_generic_accelerator_hooks_use_the_device_module(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The core's generic plugin answers for any torch accelerator through its device
    module: here a recorded A100's figures behind a stand-in module."""
    from types import SimpleNamespace

    from torchbridge import generic

    calls: list[str] = []
    props = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=85_100_000_000,
                            major=8, minor=0, multi_processor_count=108)
    module = SimpleNamespace(
        get_device_properties=lambda d: props, is_bf16_supported=lambda: True,
        mem_get_info=lambda d: (80_000_000_000, 85_100_000_000),
        memory_allocated=lambda d: 1024, memory_reserved=lambda d: 2048,
        max_memory_allocated=lambda d: 4096,
        empty_cache=lambda: calls.append("empty"),
        reset_peak_memory_stats=lambda d: calls.append("reset"),
        synchronize=lambda d: calls.append("sync"))
    monkeypatch.setattr(generic, "device_module", lambda device: module)
    dev = torch.device("cuda", 0)
    info = generic.torchbridge_device_info("cuda", dev)
    assert info.compute_capability == "8.0" and info.preferred_low_precision_dtype == "bfloat16"
    assert info.extra["multiprocessor_count"] == 108
    stats = generic.torchbridge_memory_stats("cuda", dev)
    assert (stats.allocated_bytes, stats.reserved_bytes, stats.peak_allocated_bytes) == \
        (1024, 2048, 4096)
    assert stats.free_bytes == 80_000_000_000
    assert generic.torchbridge_empty_cache("cuda", dev)
    assert generic.torchbridge_reset_peak_memory_stats("cuda", dev)
    assert generic.torchbridge_synchronize("cuda", dev)
    assert calls == ["empty", "reset", "sync"]
    assert generic.torchbridge_distributed_backend("cuda", dev) == "nccl"


def test_cpu_memory_manager_refuses_more_than_the_host_has() -> None:
    backend = torchbridge.get_backend("cpu")
    manager = backend.memory_manager(pool_max_tensors=1)
    free = backend.get_memory_stats().free_bytes
    with pytest.raises(torchbridge.OutOfMemoryError, match="not enough free memory"):
        manager.allocate_with_oom_protection((free // 4 + 1,), torch.float32)
    t = manager.allocate_tensor((256,))
    assert manager.return_to_pool(t) and not manager.return_to_pool(torch.empty(256))
    assert manager.allocate_tensor((256,)) is t
    assert manager.pool_stats()["default"] == {"hits": 1, "misses": 1, "dropped": 1,
                                               "tensors": 0, "bytes": 0}
