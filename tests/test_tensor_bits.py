"""same_bits: what "unchanged" means for the pass runner's snapshots. Plain contiguous CPU
tensors are compared byte for byte (memcmp), everything else through torch.equal on
integer views; both must give the same answer."""

from __future__ import annotations

import pytest
import torch
from torchbridge import tensor_bits
from torchbridge.tensor_bits import same_bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
          torch.int8, torch.uint8, torch.bool]


def _tensor(dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    values = torch.randn(n, generator=torch.Generator().manual_seed(0)) * 5
    return values > 0 if dtype == torch.bool else values.to(dtype)


@pytest.fixture(params=["memcmp", "torch.equal"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch.equal":
        monkeypatch.setattr(tensor_bits, "_memcmp", lambda: None)
    else:
        assert tensor_bits._memcmp() is not None  # the fast path is really taken here
    return str(request.param)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_copy_is_the_same_and_one_changed_element_is_not(path: str,
                                                            dtype: torch.dtype) -> None:
    a = _tensor(dtype)
    b = a.clone()
    assert same_bits(a, b)
    for where in (0, 500, -1):  # the first, a middle and the last element
        c = a.clone()
        c[where] = ~c[where] if dtype == torch.bool else c[where] + 1
        assert not same_bits(a, c), where


def test_bits_not_values(path: str) -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bits(nan, nan.clone())  # NaN is itself, bit for bit
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))


def test_views_strides_and_offsets(path: str) -> None:
    base = _tensor(torch.float32, 64).reshape(8, 8)
    assert same_bits(base.t(), base.t().clone())  # not contiguous: torch.equal
    assert not same_bits(base.t(), base.t().contiguous().mul(2))
    assert same_bits(base[2:4], base[2:4].clone())  # a storage offset
    assert not same_bits(base[2:4], base[4:6])
    assert same_bits(base, base)
    assert same_bits(torch.empty(0, 3), torch.empty(0, 3))
    assert not same_bits(base, base.to(torch.float64))
    assert not same_bits(base, base.reshape(64))


def test_a_parameter_is_compared_by_its_values(path: str) -> None:
    weight = torch.nn.Parameter(_tensor(torch.float32))
    saved = weight.detach().clone()
    assert same_bits(weight.detach(), saved)
    with torch.no_grad():
        weight.data[-1] += 1  # a write through .data: no version counter moves
    assert not same_bits(weight.detach(), saved)
