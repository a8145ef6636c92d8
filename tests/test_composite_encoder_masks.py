"""CompositeEncoderLayer (the transformer_composite pass) against PyTorch's own composite
computation of nn.TransformerEncoderLayer, for every mask form the layer accepts: boolean
masks mean True = masked out, 3-D masks are (batch * heads, L, L), is_causal trusts the
mask is causal, padding masks, unbatched and nested inputs, and CPU autocast."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge.optimize.pipeline import run_pipeline
from torchbridge.optimize.transformer import CompositeEncoderLayer

L, B, H, D = 6, 2, 4, 16


def _bool_random(*shape: int) -> torch.Tensor:
    mask = torch.rand(*shape, L, L) < 0.4
    return mask & ~torch.eye(L, dtype=torch.bool)  # no fully masked row (NaN in both)


def _float_additive() -> torch.Tensor:
    mask = torch.randn(L, L)
    return mask.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))


CAUSAL_BOOL = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
PADDING = torch.zeros(B, L, dtype=torch.bool)
PADDING[0, 4:] = True

# name -> (src_mask, src_key_padding_mask, is_causal), built under a fixed seed
MASKS: dict[str, Callable[[], tuple[torch.Tensor | None, torch.Tensor | None, bool]]] = {
    "none": lambda: (None, None, False),
    "bool_2d_causal": lambda: (CAUSAL_BOOL, None, False),
    "bool_2d_random": lambda: (_bool_random(), None, False),
    "float_2d_additive_inf": lambda: (_float_additive(), None, False),
    "float_3d": lambda: (torch.randn(B * H, L, L), None, False),
    "bool_3d": lambda: (_bool_random(B * H), None, False),
    "is_causal_bool": lambda: (CAUSAL_BOOL, None, True),
    "is_causal_float": lambda: (nn.Transformer.generate_square_subsequent_mask(L), None, True),
    "key_padding": lambda: (None, PADDING, False),
    "key_padding_and_causal": lambda: (CAUSAL_BOOL, PADDING, False),
}


def _pair(batch_first: bool, norm_first: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=batch_first,
                                       norm_first=norm_first).eval()
    converted = copy.deepcopy(layer)
    converted.__class__ = CompositeEncoderLayer
    return layer, converted


def _reference(layer: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    # Grad enabled with parameters that require it: PyTorch skips its fused fast path and
    # runs the layer's composite math, the computation CompositeEncoderLayer must equal.
    with torch.enable_grad():
        out: torch.Tensor = layer(*args, **kwargs)
    return out.detach()


@pytest.mark.parametrize("mask_form", list(MASKS))
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_composite_layer_matches_pytorch_for_each_mask_form(
        mask_form: str, batch_first: bool, norm_first: bool) -> None:
    layer, converted = _pair(batch_first, norm_first)
    torch.manual_seed(1)
    mask, padding, is_causal = MASKS[mask_form]()
    x = torch.randn(B, L, D) if batch_first else torch.randn(L, B, D)
    expected = _reference(layer, x, src_mask=mask, src_key_padding_mask=padding,
                          is_causal=is_causal)
    with torch.no_grad():
        got = converted(x, src_mask=mask, src_key_padding_mask=padding, is_causal=is_causal)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("mask_form", ["none", "bool_2d_random", "float_2d_additive_inf"])
def test_composite_layer_matches_pytorch_on_unbatched_input(mask_form: str) -> None:
    layer, converted = _pair(batch_first=False, norm_first=False)
    torch.manual_seed(1)
    mask = MASKS[mask_form]()[0]
    x = torch.randn(L, D)
    with torch.no_grad():
        got = converted(x, src_mask=mask)
    torch.testing.assert_close(got, _reference(layer, x, src_mask=mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("batch_first", [True, False])
def test_is_causal_without_a_mask_does_what_pytorch_does(batch_first: bool) -> None:
    # PyTorch has no mask to trust: its composite path raises, and where its fast path
    # runs instead (eval, no grad, batch_first) no mask is applied. Not causal either way.
    layer, converted = _pair(batch_first, norm_first=False)
    x = torch.randn(B, L, D) if batch_first else torch.randn(L, B, D)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        _reference(layer, x, is_causal=True)
    with torch.no_grad():
        try:
            expected = layer(x, is_causal=True)
        except RuntimeError:
            with pytest.raises(RuntimeError, match="Need attn_mask"):
                converted(x, is_causal=True)
        else:
            torch.testing.assert_close(converted(x, is_causal=True), expected,
                                       atol=1e-5, rtol=1e-5)


def test_encoder_padding_mask_in_eval_nested_tensor_path() -> None:
    # nn.TransformerEncoder turns src + padding mask into a nested tensor in eval/no_grad
    # and hands that to each layer; the converted layers must take it.
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    converted = copy.deepcopy(encoder)
    for m in converted.modules():
        if type(m) is nn.TransformerEncoderLayer:
            m.__class__ = CompositeEncoderLayer
    x = torch.randn(B, L, D)
    with torch.no_grad():
        expected = encoder(x, src_key_padding_mask=PADDING)
        got = converted(x, src_key_padding_mask=PADDING)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_form", ["bool_2d_causal", "float_2d_additive_inf", "float_3d"])
def test_composite_layer_masks_under_cpu_autocast(mask_form: str) -> None:
    # float32 masks against bf16 q/k/v: the pass runs the model under autocast at O2/O3
    layer, converted = _pair(batch_first=True, norm_first=False)
    torch.manual_seed(1)
    mask = MASKS[mask_form]()[0]
    x = torch.randn(B, L, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _reference(layer, x, src_mask=mask)
        with torch.no_grad():
            got = converted(x, src_mask=mask)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


class MaskedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.layer = nn.TransformerEncoderLayer(D, H, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # the layer itself, no is_causal hint: the boolean mask is what it gets
        out: torch.Tensor = self.layer(self.proj(x), src_mask=mask)
        return out


def test_prepared_o2_model_honours_a_boolean_causal_mask() -> None:
    torch.manual_seed(0)
    model = MaskedEncoder().eval()
    x = torch.randn(B, L, D)
    backend = torchbridge.get_backend("cpu", config=torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile", "autocast"]}))
    # the sample has no mask; the timer keeps the prepared model over O0
    result = run_pipeline(backend, model, "O2", sample_input=x,
                          timer=lambda label, fn: {"O0": 1.0}.get(label, 0.1))
    assert "transformer_composite" in result.optimizations_applied
    assert any(isinstance(m, CompositeEncoderLayer) for m in result.model.modules())
    with torch.no_grad():
        expected = model(x, CAUSAL_BOOL)
        got = result.model(x, CAUSAL_BOOL)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
