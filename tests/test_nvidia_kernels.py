"""The NVIDIA plugin's flash-attn implementations of the attention op, chosen by the
recorded device's compute capability (no GPU here: the probe seam answers)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torchbridge
from test_nvidia import FakeGPUs
from torchbridge.kernels.choice import choose
from torchbridge_nvidia import kernels

OP = "scaled_dot_product_attention"


def _verdicts(monkeypatch: pytest.MonkeyPatch, gpu: str, dtype: torch.dtype,
              installed: bool = True) -> dict[str, str | None]:
    if installed:
        monkeypatch.setattr(kernels, "_missing", lambda module, package: None)
    kernels.implementations.cache_clear()  # made once per process; remade with the patch
    FakeGPUs(monkeypatch, gpu)
    choice = choose(OP, torchbridge.get_backend("cuda"), dtype=dtype)
    return {c.implementation.name: c.reason for c in choice.candidates
            if c.provider == "nvidia"}


@pytest.fixture(autouse=True)
def fresh_implementations() -> Iterator[None]:
    yield
    kernels.implementations.cache_clear()


def test_flash_attn_3_on_hopper_flash_attn_2_on_ampere(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    assert _verdicts(monkeypatch, "H100", torch.bfloat16) == {"flash_attn_3": None,
                                                              "flash_attn_2": None}
    on_a100 = _verdicts(monkeypatch, "A100", torch.bfloat16)
    assert on_a100["flash_attn_3"] == "needs compute capability 9.0; the device has 8.0"
    assert on_a100["flash_attn_2"] is None
    on_t4 = _verdicts(monkeypatch, "T4", torch.float16)
    assert on_t4["flash_attn_2"] == "needs compute capability 8.0; the device has 7.5"
    in_fp32 = _verdicts(monkeypatch, "H100", torch.float32)
    assert in_fp32["flash_attn_3"] == "computes in torch.float16, torch.bfloat16, not " \
                                      "torch.float32"


def test_without_flash_attn_installed_doctor_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    verdicts = _verdicts(monkeypatch, "H100", torch.bfloat16, installed=False)
    assert verdicts["flash_attn_3"] == "flash-attn 3 (flash_attn_interface) is not installed"


def test_flash_attn_declines_masks_and_odd_head_sizes() -> None:
    q = torch.randn(1, 4, 8, 64)
    assert kernels._declines(q, q, q, torch.zeros(8, 8), False, None, False) == \
        "a mask is given and flash-attn takes none"
    odd = torch.randn(1, 4, 8, 60)
    assert kernels._declines(odd, odd, odd, None, False, None, False) == \
        "head_dim 60 is not a multiple of 8 up to 256"
    kv = torch.randn(1, 3, 8, 64)
    assert kernels._declines(q, kv, kv, None, False, None, True) == \
        "4 query heads do not group over 3 key heads"
    assert kernels._declines(q, kv[:, :2], kv[:, :2], None, False, None, False) == \
        "4 query heads and 2 key heads without enable_gqa"
    assert kernels._declines(q, q[:, :, :1], q[:, :, :1], None, True, None, False) == \
        "causal with query and key lengths that differ (the masks' alignments differ)"
    assert kernels._declines(q, q, q, None, True, None, False) == \
        "tensors are on cpu, not a CUDA GPU"


def test_flash_attn_gets_its_layout_and_gives_sdpa_s_back() -> None:
    """flash-attn takes (batch, seq, heads, dim); the op (batch, heads, seq, dim)."""
    import types

    def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        softmax_scale: float | None = None, causal: bool = False
                        ) -> torch.Tensor:
        assert q.shape == (2, 8, 4, 16)  # seq before heads
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
            scale=softmax_scale)
        return out.transpose(1, 2)

    fake = types.SimpleNamespace(flash_attn_func=flash_attn_func)
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    out = kernels._run(fake, q, k, v, True, None)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True))
