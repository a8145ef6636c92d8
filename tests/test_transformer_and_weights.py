"""The passes that made the transformer models and small-batch MLPs fast on CPU: the
composite encoder-layer path, low-precision weights, and one dynamo cache per prepared
model."""

from __future__ import annotations

import copy

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge.checkpoint import unwrap
from torchbridge.models import TinyDecoderLM
from torchbridge.optimize.transformer import CompositeEncoderLayer


def composite(model: nn.Module) -> nn.Module:
    converted = copy.deepcopy(model)
    for m in converted.modules():
        if type(m) is nn.TransformerEncoderLayer:
            m.__class__ = CompositeEncoderLayer
    return converted


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("norm_first", [True, False])
def test_composite_layer_is_the_same_math(batch_first: bool, norm_first: bool) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=batch_first,
                                       norm_first=norm_first).eval()
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(3, 10, 32) if batch_first else torch.randn(10, 3, 32)
    causal = nn.Transformer.generate_square_subsequent_mask(10)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[0, 6:] = True
    fast = composite(model)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
        torch.testing.assert_close(fast(x, mask=causal, is_causal=True),
                                   model(x, mask=causal, is_causal=True))
        torch.testing.assert_close(fast(x, src_key_padding_mask=padding),
                                   model(x, src_key_padding_mask=padding))


def test_composite_path_lets_autocast_reach_the_encoder() -> None:
    torch.manual_seed(0)
    model = TinyDecoderLM(128, 64, 4, 2).eval()
    ids = torch.randint(0, 128, (2, 16))
    result = torchbridge.get_backend("cpu").optimize(model, "O2", sample_input=ids)
    applied = result.optimizations_applied
    assert "transformer_composite" in applied and "autocast" in applied
    # bf16 really ran: the drift is bf16-sized, not the 0.0 the fused fast path gave
    assert result.max_rel_diff is not None and 1e-5 < result.max_rel_diff < 3e-2
    assert type(model.blocks.layers[0]) is nn.TransformerEncoderLayer  # original untouched


def test_low_precision_weights_only_at_o3_in_eval_after_autocast() -> None:
    backend = torchbridge.get_backend("cpu")
    mlp = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 32)
    o3 = backend.optimize(mlp, "O3", sample_input=x)
    assert "low_precision_weights" in o3.optimizations_applied
    inner = unwrap(o3.model)
    assert inner[0].weight.dtype == torch.bfloat16 and inner[2].bias.dtype == torch.bfloat16
    assert inner[1].weight.dtype == torch.float32  # norms stay float32
    assert o3.model(x).dtype == torch.float32 and o3.max_rel_diff < 3e-2
    assert mlp[0].weight.dtype == torch.float32
    skipped = {p.name: p.detail for p in backend.optimize(mlp.train(), "O3").skipped}
    assert "training mode" in skipped["low_precision_weights"]
    no_bf16 = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        hardware={"cpu": {"allow_bf16": False}}))
    skipped = {p.name: p.detail for p in no_bf16.optimize(mlp.eval(), "O3").skipped}
    assert skipped["low_precision_weights"] == "autocast did not run"


def test_each_prepared_model_has_its_own_compile_cache() -> None:
    """torch.compile gives up after 8 graphs per code object; the ninth prepared model
    would have run uncompiled if all shared AutocastModule.forward."""
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        precision="bfloat16"))
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for width in range(8, 8 + 10):
        prepared = backend.prepare_model(nn.Linear(width, 4).eval(), "O2")
        with torch.no_grad():
            prepared(torch.randn(2, width))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before == 10
