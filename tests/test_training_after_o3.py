"""A model prepared at O3 in eval mode, then trained: the weights low_precision_weights
stored in bfloat16 become float32 parameters again at the first call in training mode
(optimize/training_weights.py), so an optimizer step smaller than a bfloat16 step of the
weight moves it, as it moves eager's; the report says the pass was undone."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).eval()


def prepare(model: nn.Module, compile_: bool = False) -> nn.Module:
    disabled = [] if compile_ else ["compile"]
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": disabled}))
    prepared = backend.prepare_model(model, "O3", sample_input=torch.randn(16, 32))
    assert status(prepared, "low_precision_weights") == "applied"
    return prepared


def status(model: nn.Module, name: str) -> str:
    result = torchbridge.optimization_result(model)
    assert result is not None
    for label, records in (("applied", result.applied), ("skipped", result.skipped),
                           ("failed", result.failed)):
        if any(p.name == name for p in records):
            return label
    raise AssertionError(f"{name} not in the report")


def sgd_step(model: nn.Module, lr: float) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(16, 32, generator=torch.Generator().manual_seed(3)), torch.randn(16, 8)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


@pytest.mark.parametrize("compile_", [False, True], ids=["uncompiled", "compiled"])
def test_training_after_o3_updates_float32_weights(compile_: bool) -> None:
    prepared = prepare(mlp(), compile_)
    first = prepared[0].weight
    assert first.dtype == torch.bfloat16
    params = [id(p) for p in prepared.parameters()]
    prepared.train()
    before = copy.deepcopy(prepared[0].weight.detach())
    assert before.dtype == torch.bfloat16  # train() alone changes nothing: the call does

    sgd_step(prepared, lr=1e-4)  # steps far below bfloat16's resolution of these weights

    assert {p.dtype for p in prepared.parameters()} == {torch.float32}
    assert [id(p) for p in prepared.parameters()] == params  # an optimizer's still hold
    moved = (prepared[0].weight.detach() - before.float()).abs()
    assert moved.max() > 0 and (moved > 0).float().mean() > 0.5
    assert status(prepared, "low_precision_weights") == "skipped"
    summary = torchbridge.optimization_result(prepared).summary()
    assert "undone after prepare_model returned: the model was called in training mode" in \
        summary
    prepared.eval()
    with torch.no_grad():  # back in eval mode: it computes with the trained weights
        x = torch.randn(4, 32)
        plain = mlp()
        plain.load_state_dict({k: v.float() for k, v in prepared.state_dict().items()})
        expected = plain(x)
        rel = (prepared(x) - expected).abs().max() / expected.abs().max()
    assert rel < 3e-2


def test_eval_calls_keep_the_low_precision_weights() -> None:
    prepared = prepare(mlp())
    with torch.enable_grad():
        prepared(torch.randn(4, 32)).sum().backward()  # gradients, but in eval mode
    with torch.no_grad():
        prepared(torch.randn(4, 32))
    assert prepared[0].weight.dtype == torch.bfloat16
    assert status(prepared, "low_precision_weights") == "applied"


def test_a_copy_restores_its_own_weights() -> None:
    prepared = prepare(mlp())
    twin = copy.deepcopy(prepared)
    twin.train()
    sgd_step(twin, lr=1e-4)
    assert twin[0].weight.dtype == torch.float32
    assert prepared[0].weight.dtype == torch.bfloat16
    assert status(prepared, "low_precision_weights") == "applied"


def test_a_model_prepared_again_after_training_reports_its_new_preparation(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """What the first preparation's training left on the model (its weights back in
    float32) said, on the second preparation's report, that low_precision_weights was
    undone, and save_checkpoint warned of bf16 weights the model no longer held."""
    prepared = prepare(mlp())
    prepared.train()
    sgd_step(prepared, lr=1e-4)
    with caplog.at_level(logging.WARNING, "torchbridge.checkpoint"):
        torchbridge.save_checkpoint(prepared, tmp_path / "trained.pt")
    assert not [r for r in caplog.records if r.name == "torchbridge.checkpoint"]

    again = prepare(prepared.eval())  # asserts low_precision_weights applied

    assert again[0].weight.dtype == torch.bfloat16


def test_a_copy_of_a_trained_model_says_its_weights_are_float32() -> None:
    prepared = prepare(mlp())
    prepared.train()
    sgd_step(prepared, lr=1e-4)
    twin = copy.deepcopy(prepared.eval())
    assert twin[0].weight.dtype == torch.float32
    assert status(twin, "low_precision_weights") == "skipped"
