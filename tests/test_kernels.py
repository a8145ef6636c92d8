from __future__ import annotations

import pytest
import torch
import torchbridge
from torchbridge.kernels import REFERENCE_KERNELS


def test_torchbridge_kernel_hook_override_wins_over_reference() -> None:
    kernel = torchbridge.get_kernel("rms_norm")
    assert getattr(kernel, "provided_by", None) == "tb_example"
    x, w = torch.randn(4, 32), torch.randn(32)
    torch.testing.assert_close(kernel(x, w), REFERENCE_KERNELS["rms_norm"](x, w))


def test_disabled_kernels_fall_back_to_reference() -> None:
    cfg = torchbridge.TorchBridgeConfig(kernel={"disabled_ops": ["rms_norm"]})
    backend = torchbridge.get_backend(config=cfg)
    assert backend.get_kernel("rms_norm") is REFERENCE_KERNELS["rms_norm"]
    off = torchbridge.get_backend(config=torchbridge.TorchBridgeConfig(kernel={"enabled": False}))
    assert off.get_kernel("rms_norm") is REFERENCE_KERNELS["rms_norm"]


def test_reference_kernels_are_right() -> None:
    q = torch.randn(2, 4, 8, 16)
    out = torchbridge.get_kernel("scaled_dot_product_attention")(q, q, q, is_causal=True)
    scores = (q @ q.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ q)
    g, u = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(torchbridge.get_kernel("silu_mul")(g, u), g * torch.sigmoid(g) * u)


def test_unknown_op_is_a_kernel_error() -> None:
    with pytest.raises(torchbridge.KernelError, match="unknown op 'flash_mlp'"):
        torchbridge.get_kernel("flash_mlp")
