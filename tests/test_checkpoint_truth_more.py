"""Checkpoints that say what they did: a distributed load refuses entries the model lacks
and an optimizer over another model's parameters; load_checkpoint(dtype=) casts the
model's weights only, and refuses values the dtype cannot hold; saving a model whose
weights prepare_model stored in bf16 logs a warning."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchbridge
import torchbridge.distributed as tbd
from torch import nn
from torchbridge import CheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(params=["no group", "one-process group"])
def group(request: pytest.FixtureRequest) -> Iterator[None]:
    """Both ways a distributed checkpoint runs in one process: without a process group,
    and in a gloo group of one rank (the collective path)."""
    if request.param == "no group":
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def mlp(*widths: int) -> nn.Sequential:
    torch.manual_seed(len(widths))
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def copy_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = model.state_dict()
    return now.keys() == before.keys() and all(torch.equal(now[k], v)
                                               for k, v in before.items())


# -- 1. a distributed load refuses entries the model lacks -----------------------------------

def test_a_distributed_load_refuses_entries_the_model_lacks(tmp_path: Path, group: None
                                                             ) -> None:
    tbd.save_distributed_checkpoint(mlp(8, 8, 8, 4), tmp_path)  # 0.*, 2.*, 4.*
    small = mlp(8, 8)  # 0.weight, 0.bias
    before = copy_of(small)
    with pytest.raises(CheckpointError, match=r"lacks \(2\.bias, 2\.weight, 4\.bias, "
                                              r"4\.weight\)"):
        tbd.load_distributed_checkpoint(small, tmp_path)
    assert unchanged(small, before)
    same = mlp(8, 8, 8, 4)
    tbd.load_distributed_checkpoint(same, tmp_path)  # the model it was saved from loads
    assert unchanged(same, copy_of(mlp(8, 8, 8, 4)))


# -- 2. dtype= refuses values the dtype cannot hold ------------------------------------------

def test_a_cast_that_would_give_inf_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    path = torchbridge.save_checkpoint(
        {"ok": torch.ones(2), "w": torch.tensor([1.0, 7e4, -3e38, 1e-8])}, tmp_path / "m.pt")
    with pytest.raises(CheckpointError, match=r"'w' holds a value of magnitude 3e\+38, "
                                              r"beyond torch\.float16's largest value 65504"):
        torchbridge.load_checkpoint(path, dtype=torch.float16)
    # Rounding to the largest value and underflow to zero are what a cast does: loaded.
    path = torchbridge.save_checkpoint({"w": torch.tensor([65519.0, -1e-8, float("inf")])},
                                       tmp_path / "edge.pt")
    loaded = torchbridge.load_checkpoint(path, dtype=torch.float16)["w"]
    assert loaded.tolist() == [65504.0, -0.0, float("inf")]


# -- 3. dtype= casts the model's weights, not the optimizer's state --------------------------

def test_dtype_casts_the_model_weights_and_leaves_the_training_state(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "loss": torch.tensor(0.5)}
    path = torchbridge.save_checkpoint(saved, tmp_path / "train.pt")
    loaded = torchbridge.load_checkpoint(path, dtype=torch.bfloat16)
    assert {v.dtype for v in loaded["model"].values()} == {torch.bfloat16}
    for index, state in saved["optimizer"]["state"].items():
        for name, value in state.items():  # step, exp_avg, exp_avg_sq
            got = loaded["optimizer"]["state"][index][name]
            assert got.dtype == value.dtype and torch.equal(got, value), name
    assert loaded["loss"].dtype == torch.float32
    # A plain state dict is the model's: every floating tensor is cast.
    flat = torchbridge.save_checkpoint(model, tmp_path / "m.pt")
    assert {v.dtype for v in torchbridge.load_checkpoint(flat, dtype=torch.bfloat16
                                                         ).values()} == {torch.bfloat16}


# -- 5. saving a model prepare_model stored in bf16 says so ----------------------------------

def saved_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "torchbridge.checkpoint" and r.levelno == logging.WARNING]


def skip_unless_applied(prepared: nn.Module, name: str) -> None:
    report = torchbridge.optimization_result(prepared)
    assert report is not None
    if name not in [r.name for r in report.applied]:
        pytest.skip(f"{name} did not run here: {report.summary()}")


def the_save_warning(prepared: nn.Module, path: Path, caplog: pytest.LogCaptureFixture
                     ) -> str:
    """save_checkpoint's one warning on saving `prepared` to `path`."""
    with caplog.at_level(logging.WARNING, "torchbridge.checkpoint"):
        torchbridge.save_checkpoint(prepared, path)
    warnings = saved_warnings(caplog)
    assert len(warnings) == 1, warnings
    return warnings[0]


def test_saving_a_model_with_bf16_weights_from_prepare_model_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = mlp(16, 32, 4).eval()
    config = torchbridge.TorchBridgeConfig(precision="bfloat16",  # whatever the CPU has
                                           optimization={"disabled_passes": ["compile"]})
    prepared = torchbridge.get_backend("cpu", config=config).prepare_model(model, "O3")
    skip_unless_applied(prepared, "low_precision_weights")
    warning = the_save_warning(prepared, tmp_path / "prepared.pt", caplog)
    assert "low_precision_weights" in warning and "4 tensors in bfloat16" in warning
    assert "save the model you prepared from" in warning
    # What the prepared model holds is written as it is: weights and biases in bf16.
    saved = torchbridge.load_checkpoint(tmp_path / "prepared.pt")
    assert {v.dtype for v in saved.values()} == {torch.bfloat16}
    caplog.clear()
    with caplog.at_level(logging.WARNING, "torchbridge.checkpoint"):
        torchbridge.save_checkpoint(model, tmp_path / "model.pt")
    assert not saved_warnings(caplog)


def test_saving_a_quantized_model_names_its_quantized_tensors(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """torchao's quantized weights read as bfloat16: the warning called them "tensors in
    bfloat16", which the model as built would load. It names them as quantized now."""
    pytest.importorskip("torchao")
    model = mlp(64, 128, 8).eval()
    config = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": ["compile"]})
    prepared = torchbridge.get_backend("cpu", config=config).prepare_model(
        model, "O3", sample_input=torch.randn(16, 64), quantize="int8_weight_only")
    skip_unless_applied(prepared, "quantize")
    warning = the_save_warning(prepared, tmp_path / "prepared.pt", caplog)
    assert "quantize" in warning and "quantized tensors (" in warning
    assert "the model as built cannot load the quantized ones" in warning


# -- 6. an optimizer over another model's parameters ------------------------------------------

def test_an_optimizer_of_another_model_is_a_checkpoint_error(tmp_path: Path, group: None
                                                              ) -> None:
    source = mlp(8, 8, 4)
    optimizer = torch.optim.Adam(source.parameters())
    source(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    tbd.save_distributed_checkpoint(source, tmp_path / "ck", optimizer=optimizer)
    model = mlp(8, 8, 4)
    before = copy_of(model)
    other = torch.optim.Adam(mlp(8, 8, 4).parameters())
    message = r"4 of the optimizer's 4 parameters are not parameters of the model"
    with pytest.raises(CheckpointError, match=message):
        tbd.load_distributed_checkpoint(model, tmp_path / "ck", optimizer=other)
    assert unchanged(model, before)
    with pytest.raises(CheckpointError, match=message):
        tbd.save_distributed_checkpoint(model, tmp_path / "ck2", optimizer=other)
    assert not (tmp_path / "ck2").exists()
