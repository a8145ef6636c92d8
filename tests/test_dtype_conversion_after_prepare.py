"""A model converted to another floating dtype after prepare_model (`.half()`, `.double()`,
`.bfloat16()`, `.to(dtype)`) computes in that dtype as converted: autocast in bfloat16 had
kept computing a float64 model in bfloat16, returned float32 from a bfloat16 one, and a
float16 one raised "mixed dtype (CPU)". Converted back to float32 it runs under autocast
again, its weights float32. The report says what was undone."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torchbridge
from torch import nn


class TiedLM(nn.Module):
    """An embedding tied to the LM head: low_precision_weights stores the shared weight in
    bfloat16 and casts the embedding's output back (forward.outputs_cast_back)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(self.norm(h + self.mlp(h)))  # type: ignore[no-any-return]


IDS = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))


def prepare(compile_: bool) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = TiedLM().eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": [] if compile_ else ["compile"]}))
    prepared = backend.prepare_model(model, "O3", sample_input=IDS)
    applied = [p.name for p in torchbridge.optimization_result(prepared).applied]
    assert {"autocast", "low_precision_weights"} <= set(applied)
    return model, prepared


def as_plain(prepared: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model as built holding the prepared model's (rounded) weights, in `dtype`."""
    plain = TiedLM().eval()
    plain.load_state_dict({k: v.float() for k, v in prepared.state_dict().items()})
    return plain.to(dtype)


def status(model: nn.Module, name: str) -> str:
    result = torchbridge.optimization_result(model)
    assert result is not None
    return next(label for label, records in (("applied", result.applied),
                                             ("skipped", result.skipped))
                if name in [p.name for p in records])


CONVERSIONS: dict[str, tuple[Callable[[nn.Module], nn.Module], torch.dtype]] = {
    "half": (lambda m: m.half(), torch.float16),
    "bfloat16": (lambda m: m.bfloat16(), torch.bfloat16),
    "double": (lambda m: m.double(), torch.float64),
    "to(float64)": (lambda m: m.to(torch.float64), torch.float64),
}


@pytest.mark.parametrize("compile_", [False, True], ids=["uncompiled", "compiled"])
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_a_converted_model_computes_in_its_new_dtype(conversion: str, compile_: bool) -> None:
    _, prepared = prepare(compile_)
    convert, dtype = CONVERSIONS[conversion]

    converted = convert(prepared)

    with torch.no_grad():
        out = converted(IDS)
        expected = as_plain(converted, dtype)(IDS)
    assert out.dtype == dtype
    # What the model as built computes in that dtype with these weights: float64 to
    # float64's rounding, not bfloat16's.
    tolerance = {torch.float64: 1e-12}.get(dtype, 1e-2)
    assert float((out - expected).abs().max() / expected.abs().max()) < tolerance
    assert status(converted, "autocast") == "skipped"
    summary = torchbridge.optimization_result(converted).summary()
    assert f"converted to {str(dtype).removeprefix('torch.')}" in summary


def test_converted_back_to_float32_it_runs_under_autocast_with_float32_weights() -> None:
    model, prepared = prepare(compile_=False)
    prepared.double().float()
    with torch.no_grad():
        out, expected = prepared(IDS), model(IDS)
    assert out.dtype == torch.float32
    assert status(prepared, "autocast") == "applied"
    assert prepared.mlp[0].weight.dtype == torch.float32
    assert status(prepared, "low_precision_weights") == "skipped"
    assert float((out - expected).abs().max() / expected.abs().max()) < 3e-2


def test_a_converted_model_trains_in_its_new_dtype() -> None:
    """Training after a conversion put the weights low_precision_weights had cast back in
    float32 beside float64 norms: "mat1 and mat2 must have the same dtype"."""
    _, prepared = prepare(compile_=False)
    prepared.double().train()
    optimizer = torch.optim.SGD(prepared.parameters(), lr=1e-3)
    prepared(IDS).sum().backward()
    optimizer.step()
    assert {p.dtype for p in prepared.parameters()} == {torch.float64}


def test_a_move_to_the_same_device_keeps_autocast() -> None:
    _, prepared = prepare(compile_=False)
    prepared.to("cpu")
    assert prepared.mlp[0].weight.dtype == torch.bfloat16
    assert status(prepared, "autocast") == "applied"


def test_a_copy_of_a_converted_model_stays_converted() -> None:
    _, prepared = prepare(compile_=False)
    twin = copy.deepcopy(prepared.double())
    with torch.no_grad():
        assert twin(IDS).dtype == torch.float64
    twin.float()  # the copy's own conversion, not the original's
    assert status(twin, "autocast") == "applied"
    assert status(prepared, "autocast") == "skipped"
