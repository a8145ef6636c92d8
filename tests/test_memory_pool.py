"""The tensor pool under misuse and threads: a buffer returned twice, views of large
tensors, byte bounds counted on storage, and many threads allocating and returning at once."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest
import torch
import torchbridge
from torchbridge import ConfigurationError
from torchbridge.memory import MemoryManager


@pytest.fixture
def manager() -> MemoryManager:
    return torchbridge.get_backend("cpu").memory_manager()


def test_a_buffer_returned_twice_is_pooled_once(manager: MemoryManager) -> None:
    t = manager.allocate_tensor((64,))
    assert manager.return_to_pool(t) is True
    assert manager.return_to_pool(t) is False
    assert manager.return_to_pool(t.view(8, 8)) is False  # the same buffer in another shape
    a = manager.allocate_tensor((64,))
    b = manager.allocate_tensor((64,))
    assert a.data_ptr() != b.data_ptr()  # two callers never share one buffer
    stats = manager.pool_stats()["default"]
    assert stats["refused"] == 2 and stats["hits"] == 1 and stats["tensors"] == 0


def test_a_view_is_refused_and_never_keeps_its_base_alive(manager: MemoryManager) -> None:
    big = torch.empty(4 << 20)  # 16 MB
    for view in (big[:1], big[1:], big.view(1024, -1).t(), big[::2]):
        assert manager.return_to_pool(view) is False
    assert manager.pool_stats()["default"]["bytes"] == 0
    assert manager.pool_stats()["default"]["refused"] == 4
    assert manager.return_to_pool(torch.empty(0)) is False  # holds nothing worth keeping
    assert manager.return_to_pool(big.view(-1, 4)) is True  # all of its storage: kept
    assert manager.pool_stats()["default"]["bytes"] == big.untyped_storage().nbytes()


class _RuntimeOwned(torch.Tensor):
    """A tensor as an XLA tensor looks to the pool: its storage has no address here."""

    def untyped_storage(self) -> torch.UntypedStorage:  # type: ignore[override]
        storage = super().untyped_storage()

        class _Invalid:
            def data_ptr(self) -> int:
                raise RuntimeError("Attempted to access the data pointer on an invalid "
                                   "python storage.")

            def nbytes(self) -> int:
                return storage.nbytes()

        return _Invalid()  # type: ignore[return-value]


def _runtime_owned(*shape: int) -> torch.Tensor:
    return torch.Tensor._make_subclass(_RuntimeOwned, torch.empty(shape))


def test_a_tensor_whose_runtime_owns_its_buffer_is_refused_not_a_crash(
        manager: MemoryManager) -> None:
    # return_to_pool of an XLA tensor raised "Attempted to access the data pointer on an
    # invalid python storage".
    assert manager.return_to_pool(_runtime_owned(64)) is False
    assert manager.pool_stats()["default"]["refused"] == 1


def test_on_a_lazy_device_running_out_of_memory_is_an_out_of_memory_error(
        manager: MemoryManager, monkeypatch: pytest.MonkeyPatch) -> None:
    # On XLA torch.empty only records the tensor: 4 TiB "allocated" without an error, and
    # the first sync anywhere later raised the runtime's error. The allocation now runs
    # it, and XLA's wording is an OutOfMemoryError after one retry.
    import torchbridge.memory as core_memory

    events: list[str] = []
    backend = manager.backend
    monkeypatch.setattr(core_memory, "_allocate", lambda shape, dtype, device:
                        events.append("allocate") or _runtime_owned(*shape))
    monkeypatch.setattr(backend, "empty_cache", lambda: events.append("empty_cache"))

    def sync(index: int | None = None) -> None:
        events.append("sync")
        raise torchbridge.DeviceError("no plugin answered torchbridge_synchronize: "
                                      "RESOURCE_EXHAUSTED: Out of memory allocating 4096 bytes")

    monkeypatch.setattr(backend, "synchronize", sync)
    with pytest.raises(torchbridge.OutOfMemoryError, match="failed again after emptying"):
        manager.allocate_with_oom_protection((1024,), torch.float32)
    assert events == ["allocate", "sync", "empty_cache", "allocate", "sync"]
    # Any other failure of the sync is not taken for running out of memory.
    monkeypatch.setattr(backend, "synchronize", lambda index=None: (_ for _ in ()).throw(
        torchbridge.DeviceError("the runtime is gone")))
    with pytest.raises(torchbridge.DeviceError, match="the runtime is gone") as raised:
        manager.allocate_with_oom_protection((1024,), torch.float32)
    assert not isinstance(raised.value, torch.OutOfMemoryError)


def test_byte_bounds_hold_on_storage_bytes() -> None:
    backend = torchbridge.get_backend("cpu")
    manager = MemoryManager(backend, pool_max_bytes=4096)
    assert manager.return_to_pool(torch.empty(1024)) is True  # 4096 bytes
    assert manager.return_to_pool(torch.empty(1)) is False    # full: dropped
    assert manager.pool_stats()["default"]["dropped"] == 1
    assert manager.clear_pool() == 4096


def test_pool_limits_must_be_integers_at_least_zero() -> None:
    backend = torchbridge.get_backend("cpu")
    for limits in ({"pool_max_tensors": -1}, {"pool_max_tensors": float("nan")},
                   {"pool_max_bytes": 1.5}, {"pool_max_tensors": True}):
        with pytest.raises(ConfigurationError, match="pool limits must be integers >= 0"):
            MemoryManager(backend, **limits)  # type: ignore[arg-type]


def test_pooled_tensors_carry_no_autograd_history(manager: MemoryManager) -> None:
    w = torch.ones(16, requires_grad=True)
    assert manager.return_to_pool(w)
    again = manager.allocate_tensor((16,))
    assert not again.requires_grad and again.data_ptr() == w.data_ptr()


def test_safety_margin_must_be_finite(manager: MemoryManager) -> None:
    for margin in (float("inf"), float("nan"), 0.5):
        with pytest.raises(ConfigurationError, match=r">= 1\.0 and finite"):
            manager.allocate_with_oom_protection((4,), safety_margin=margin)


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # interleave threads inside the pool's bookkeeping
    yield
    sys.setswitchinterval(before)


def test_many_threads_keep_the_pool_consistent_and_never_share_a_buffer(
        frequent_thread_switches: None) -> None:
    """8 threads each return 6 tensors and take 6 back, 800 times, through a pool of at
    most 4: every count must match the pool's contents, and no buffer may be held by two
    threads, or held and pooled, at the end. (Without the pool's lock the byte count
    drifts from the contents within a run.)"""
    manager = MemoryManager(torchbridge.get_backend("cpu"), pool_max_tensors=4)
    held = [[torch.empty(4) for _ in range(6)] for _ in range(8)]
    start = threading.Barrier(8)

    def worker(me: int) -> None:
        start.wait()
        mine = held[me]
        for _ in range(800):
            for t in mine:
                manager.return_to_pool(t, "shared")
            mine = [manager.allocate_tensor((4,), pool_id="shared") for _ in range(6)]
        held[me] = mine

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = manager.pool_stats("shared")["shared"]
    pooled = [t for bucket in manager._pools.get("shared", {}).values() for t in bucket]
    assert stats["tensors"] == len(pooled) <= 4
    assert stats["bytes"] == sum(t.untyped_storage().nbytes() for t in pooled)
    assert stats["hits"] + stats["misses"] == 8 * 6 * 800
    addresses = [t.data_ptr() for mine in held for t in mine] + [t.data_ptr() for t in pooled]
    assert len(addresses) == len(set(addresses))


def test_an_unenforced_memory_fraction_says_whether_anything_keeps_within_it(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The warning said allocate_with_oom_protection keeps within the fraction, also where
    # the backend reports no total memory (XLA on CPU) and it cannot.
    import dataclasses

    from torchbridge.memory import apply_memory_fraction

    config = torchbridge.TorchBridgeConfig.load(memory={"max_memory_fraction": 0.5})
    backend = torchbridge.get_backend("cpu", config)
    with caplog.at_level("WARNING", logger="torchbridge.memory"):
        assert apply_memory_fraction(backend) is None
    assert "only allocate_with_oom_protection keeps within it" in caplog.text
    caplog.clear()
    stats = dataclasses.replace(backend.get_memory_stats(), total_bytes=None)
    monkeypatch.setattr(backend, "get_memory_stats", lambda index=None: stats)
    with caplog.at_level("WARNING", logger="torchbridge.memory"):
        apply_memory_fraction(backend)
    assert "nothing keeps within it: the backend reports no total memory" in caplog.text
