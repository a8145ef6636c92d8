"""low_precision_weights stores Linear and Conv weights in bfloat16, and autocast covers the
model's forward. A submodule called on its own (transformers' generate() calls an
encoder-decoder's encoder directly, CLIP's feature methods its text and vision models)
runs under autocast too: its float32 activations met bfloat16 weights there ("mat1 and
mat2 must have the same dtype"). No timing: an injected timer keeps the prepared model."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torchbridge
from torch import nn
from torchbridge.levels import LEVEL_TOLERANCE
from torchbridge.optimize.measure import output_drift
from torchbridge.optimize.pipeline import run_pipeline


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv1d(4, 16, 3, padding=1), nn.GELU(),
                                     nn.Flatten(), nn.Linear(16 * 8, 32))
        self.decoder = nn.Linear(32, 8)

    def get_encoder(self) -> nn.Module:
        return self.encoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.decoder(self.encoder(x))
        return out


def _prepared_timer(label: str, fn: Any) -> float:
    fn()
    return 1.0 if label == "prepared" else 2.0


def _prepare() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = EncoderDecoder().eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    result = run_pipeline(backend, model, "O3", sample_input=torch.randn(2, 4, 8),
                          timer=_prepared_timer)
    assert "low_precision_weights" in result.optimizations_applied
    assert result.model.encoder[3].weight.dtype == torch.bfloat16
    return model, result.model


def test_a_submodule_called_on_its_own_runs_under_autocast() -> None:
    """Before: RuntimeError "expected m1 and m2 to have the same dtype" (the Conv1d: "Input
    type (float) and bias type (c10::BFloat16) should be the same")."""
    model, prepared = _prepare()
    x = torch.randn(3, 4, 8)
    with torch.no_grad():
        for twin in (prepared, copy.deepcopy(prepared)):
            expected, got = model.get_encoder()(x), twin.get_encoder()(x)
            assert got.dtype == torch.float32  # the model's own dtype, as its forward gives
            assert output_drift(expected, got)[1] <= LEVEL_TOLERANCE["O3"]
            assert output_drift(model(x), twin(x))[1] <= LEVEL_TOLERANCE["O3"]


def test_inside_the_models_forward_the_modules_add_no_autocast_of_their_own() -> None:
    _, prepared = _prepare()
    seen: list[torch.dtype] = []
    prepared.decoder.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    with torch.no_grad():
        prepared(torch.randn(3, 4, 8))
    assert seen == [torch.bfloat16]  # autocast's output, inside the model's forward


def test_the_reports_reasons_say_what_the_weights_are() -> None:
    """A bf16 model was skipped because "every eligible weight is shared with an embedding
    or norm" (none was); weight_norm Linears were reported with their weights stored in
    bf16, though only their biases were."""
    from torch.nn.utils import parametrizations

    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    result = run_pipeline(backend, model.to(torch.bfloat16), "O3",
                          sample_input=torch.randn(4, 16, dtype=torch.bfloat16),
                          timer=_prepared_timer)
    record = next(p for p in result.passes if p.name == "low_precision_weights")
    assert (record.status, record.detail) == ("skipped",
                                              "every eligible weight is in bfloat16 already")
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    with torch.no_grad():
        parametrizations.weight_norm(model[2])
    result = run_pipeline(backend, model, "O3", sample_input=torch.randn(4, 16),
                          timer=_prepared_timer)
    assert "low_precision_weights" in result.optimizations_applied
    assert "low_precision_weights: 1 module(s) compute their weight at each call (a " \
           "parametrization, weight_norm or pruning), which stays in its dtype: 2" \
           in result.notes
