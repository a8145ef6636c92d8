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
    from torchbridge.builtin.cpu import host

    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx2"}))
    info = torchbridge.get_backend("cpu").get_device_info()
    assert info.preferred_low_precision_dtype is None  # no native bf16: stay in float32
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    info = torchbridge.get_backend("cpu").get_device_info()
    assert info.preferred_low_precision_dtype == "bfloat16"


def test_precision_config_overrides_device_preference() -> None:
    backend = torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(precision="fp32"))
    assert backend.low_precision_dtype() is None
    a = torch.randn(4, 4)
    with backend.autocast():
        assert (a @ a).dtype == torch.float32


def test_num_threads_config_is_applied() -> None:
    """The cpu plugin's torchbridge_backend_created applies hardware.cpu.num_threads."""
    before = torch.get_num_threads()
    try:
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(
            hardware={"cpu": {"num_threads": 1}}))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_creating_a_backend_leaves_process_state_alone() -> None:
    """No config asks for anything: the user's logger level and torch's thread count stay
    as they were. A config that asks for a logging level gets it."""
    import logging

    logger = logging.getLogger("torchbridge")
    saved, threads = logger.level, torch.get_num_threads()
    try:
        logger.setLevel(logging.ERROR)
        torchbridge.get_backend()
        assert logger.level == logging.ERROR and torch.get_num_threads() == threads
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(logging_level="INFO"))
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(saved)


def test_device_index_parsing() -> None:
    with pytest.raises(torchbridge.DeviceError, match="index 3 does not exist"):
        torchbridge.get_backend("cpu:3")
    with pytest.raises(torchbridge.DeviceError, match="bad device index"):
        torchbridge.get_backend("cpu:x")
    with pytest.raises(torchbridge.DeviceError, match="in backend name cpu:x"):
        torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(backend="cpu:x"))
    with pytest.raises(torchbridge.DeviceError, match="bad device index"):
        torchbridge.get_backend("cpu:\u00b2")  # a digit to str.isdigit, not to int()


def test_cpu_hosted_backend_hooks_receive_every_device_index() -> None:
    """The example backend (two pretend devices on the host CPU): devices[1] reaches its
    hooks as cpu:1, and it answers every hook itself."""
    backend = torchbridge.get_backend("example")
    assert backend.device == torch.device("cpu")  # tensors still land on the CPU
    assert backend.get_device_info(1).device == "cpu:1"
    assert backend.get_device_info(1).name == "Example Accelerator #1"
    assert backend.get_memory_stats(1).device == "cpu:1"
    assert backend.answered_by["torchbridge_device_info"] == "example_backend"


def test_device_hooks_answer_for_cpu() -> None:
    """torchbridge_synchronize, torchbridge_empty_cache, torchbridge_reset_peak_memory_stats,
    torchbridge_memory_stats and torchbridge_distributed_backend answer for the CPU, each
    from the cpu plugin itself (no fallback)."""
    backend = torchbridge.get_backend("cpu")
    backend.synchronize()
    backend.empty_cache()
    backend.reset_peak_memory_stats()
    assert backend.get_memory_stats().total_bytes > 0
    assert backend.distributed_backend == "gloo"
    assert set(backend.answered_by) == {
        "torchbridge_synchronize", "torchbridge_empty_cache",
        "torchbridge_reset_peak_memory_stats", "torchbridge_memory_stats",
        "torchbridge_distributed_backend"}
    assert set(backend.answered_by.values()) == {"cpu"}


def test_generic_accelerator_hooks_use_the_device_module(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The core's generic plugin answers for any torch accelerator through its device
    module: here a recorded A100's figures behind a stand-in module."""
    from types import SimpleNamespace

    from torchbridge.builtin import generic

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
    import torch.distributed as dist

    # torch's table says nccl for cuda; only a build with NCCL gets that answer.
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert generic.torchbridge_distributed_backend("cuda", dev) == "nccl"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert generic.torchbridge_distributed_backend("cuda", dev) is None
    assert generic.torchbridge_distributed_backend("cpu", torch.device("cpu")) == "gloo"


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
                                               "refused": 0, "tensors": 0, "bytes": 0}
