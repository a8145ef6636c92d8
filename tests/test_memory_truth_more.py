"""MemoryManager on bad input, and what the pool says when it refuses: a dtype that is not a
torch.dtype, a bool taken for a dimension, a negative byte count, and a non-contiguous
tensor that owns all of its storage."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchbridge
from torchbridge import ConfigurationError, TorchBridgeError
from torchbridge.memory import MemoryManager


@pytest.fixture
def manager() -> MemoryManager:
    return torchbridge.get_backend("cpu").memory_manager()


def test_a_dtype_that_is_not_a_torch_dtype_is_refused_naming_it(
        manager: MemoryManager) -> None:
    # "float32" and Python's float gave AttributeError: 'str' object has no attribute
    # 'itemsize' (and with OOM protection off, torch.empty's own TypeError).
    unprotected = torchbridge.get_backend(
        "cpu", torchbridge.TorchBridgeConfig.load(memory={"enable_oom_protection": False})
    ).memory_manager()
    calls: list[Callable[[Any], torch.Tensor]] = [
        (lambda d: manager.allocate_with_oom_protection((2, 3), d)),
        (lambda d: manager.allocate_tensor((2, 3), d, pool_id="typed")),
        (lambda d: unprotected.allocate_with_oom_protection((2, 3), d)),
    ]
    for call in calls:
        for bad, named in (("float32", r"'float32'.*did you mean torch\.float32"),
                           (float, r"Python type float.*did you mean torch\.float64"),
                           (None, "got None")):
            with pytest.raises(ConfigurationError, match=named) as raised:
                call(bad)
            assert isinstance(raised.value, (TorchBridgeError, ValueError))
            assert raised.value.field == "dtype" and raised.value.value is bad
    # A refused argument is no pool miss; a torch.dtype still works.
    assert manager.pool_stats("typed")["typed"]["misses"] == 0
    assert manager.allocate_tensor((2, 3), torch.float16).dtype == torch.float16


def test_a_bool_is_not_a_dimension(manager: MemoryManager) -> None:
    # (True, 3) passed the shape check (a bool is an int to isinstance) and failed inside
    # torch.empty with "must be tuple of ints, but found element of type bool".
    for shape in ((True, 3), (2, False), True, [False]):
        with pytest.raises(ConfigurationError, match="shape must be non-negative integers"):
            manager.allocate_with_oom_protection(shape)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match="shape must be non-negative integers"):
            manager.allocate_tensor(shape)  # type: ignore[arg-type]
    # Other bad dimensions are the same error (still a ValueError), good ones still work.
    for other in ((-1, 3), (2.0, 3)):
        with pytest.raises(ValueError, match="shape must be non-negative integers"):
            manager.allocate_with_oom_protection(other)  # type: ignore[arg-type]
    assert manager.allocate_with_oom_protection((1, 3)).shape == (1, 3)
    assert manager.allocate_with_oom_protection(0).shape == (0,)


def test_a_negative_byte_count_is_refused(manager: MemoryManager) -> None:
    # check_allocation(-10**18) passed silently.
    for nbytes in (-10**18, -1, float("nan"), 1.5):  # 1.5 bytes is no byte count either
        with pytest.raises(ConfigurationError, match="nbytes must be a byte count >= 0"):
            manager.check_allocation(nbytes)  # type: ignore[arg-type]
    manager.check_allocation(0)
    manager.check_allocation(1024)
    manager.check_allocation(1024.0)


def test_a_non_contiguous_owner_is_refused_for_what_it_is(
        manager: MemoryManager, caplog: pytest.LogCaptureFixture) -> None:
    # The refusal said "it is a view (128 bytes of a 128-byte storage); return the tensor
    # that owns the storage" of a tensor that owns all of its storage. The pool hands a
    # tensor out as it is, so a non-contiguous one is refused, saying so.
    transposed = torch.empty(8, 4).t()
    channels_last = torch.empty(2, 3, 4, 4).to(memory_format=torch.channels_last)
    for owner in (transposed, channels_last):
        assert owner.untyped_storage().nbytes() == owner.nbytes  # all of its storage
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="torchbridge.memory"):
            assert manager.return_to_pool(owner) is False
        assert "not contiguous" in caplog.text
        assert "is a view" not in caplog.text and "owns the storage" not in caplog.text
    assert manager.pool_stats()["default"]["refused"] == 2
    # A part of a storage is still called a view, and the pool still hands out the layout
    # a caller asked for.
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="torchbridge.memory"):
        assert manager.return_to_pool(torch.empty(64)[:8]) is False
    assert "it is a view (32 bytes of a 256-byte storage)" in caplog.text
    assert manager.return_to_pool(transposed.contiguous()) is True
    again = manager.allocate_tensor((4, 8))
    assert again.is_contiguous() and manager.pool_stats()["default"]["hits"] == 1


def test_a_byte_count_of_numpy_or_torch_is_a_byte_count(manager: MemoryManager) -> None:
    # np.prod(shape) * 4 or a 0-d tensor passed before the check for bad counts; they must
    # still (a review found them refused).
    import numpy as np

    for count in (np.int64(64), np.float32(64.0), torch.tensor(64)):
        manager.check_allocation(count)
