"""Checkpoints (atomic, weights_only, dtype and device mapping) and cross-backend validation
on the backends every machine has. The XLA round trips are in tests/xla."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import CheckpointError
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass
from torchbridge.types import Detection


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()


def test_round_trip_with_dtype_and_backend(tmp_path: Path) -> None:
    m = model()
    path = torchbridge.save_checkpoint(m, tmp_path / "m.pt")
    state = torchbridge.load_checkpoint(path)
    assert state.keys() == m.state_dict().keys()
    for key, value in m.state_dict().items():
        assert torch.equal(state[key], value)
    half = torchbridge.load_checkpoint(path, backend="cpu", dtype=torch.bfloat16)
    assert {t.dtype for t in half.values()} == {torch.bfloat16}
    assert torch.load(path, weights_only=True).keys() == state.keys()  # plain torch reads it


def test_prepared_models_save_under_the_original_keys(tmp_path: Path) -> None:
    m = model()
    prepared = torchbridge.get_backend("cpu").prepare_model(m, "O2")
    torchbridge.save_checkpoint(prepared, tmp_path / "p.pt")
    fresh = model()
    fresh.load_state_dict(torchbridge.load_checkpoint(tmp_path / "p.pt"))


def test_a_crash_mid_save_keeps_the_previous_checkpoint(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    path = tmp_path / "m.pt"
    torchbridge.save_checkpoint({"w": torch.ones(3)}, path)
    good = path.read_bytes()
    real_save = torch.save

    def crash(obj: object, f: object) -> None:
        real_save({"w": torch.zeros(100000)}, f)  # half a file is on disk...
        raise KeyboardInterrupt("power cut")      # ...when the process dies

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        torchbridge.save_checkpoint({"w": torch.zeros(3)}, path)
    assert path.read_bytes() == good
    assert os.listdir(tmp_path) == ["m.pt"]  # no temporary file left behind


def test_weights_only_refuses_pickled_objects_and_says_how_to_opt_out(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"w": torch.ones(2), "when": Path("/tmp")}, path)
    with pytest.raises(CheckpointError, match=r"weights_only=False.*runs code"):
        torchbridge.load_checkpoint(path)
    assert torchbridge.load_checkpoint(path, weights_only=False)["when"] == Path("/tmp")


def test_bad_files_and_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        torchbridge.load_checkpoint(tmp_path / "missing.pt")
    truncated = tmp_path / "cut.pt"
    torchbridge.save_checkpoint({"w": torch.ones(1000)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="damaged or not a checkpoint"):
        torchbridge.load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match=r"directory .* does not exist"):
        torchbridge.save_checkpoint({}, tmp_path / "no" / "dir.pt")
    with pytest.raises(CheckpointError, match=r"floating torch\.dtype"):
        torchbridge.load_checkpoint(truncated, dtype=torch.int8)


class PerturbedBackend:
    """A backend on the CPU whose prepare_model adds noise to the weights: what a broken
    kernel or a wrong precision setting on a real accelerator looks like."""

    @torchbridge.hookimpl
    def torchbridge_detect(self) -> Detection:
        return Detection("perturbed", True, -50, "cpu", 1, "Test")

    @torchbridge.hookimpl(tryfirst=True)
    def torchbridge_optimization_passes(self, backend: torchbridge.Backend,
                                        level: OptimizationLevel) -> list[OptimizationPass]:
        if backend.name != "perturbed":
            return []

        def perturb(m: nn.Module, ctx: object) -> nn.Module:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn_like(p) * 1e-2)
            return m

        return [OptimizationPass("perturb", "adds noise", OptimizationLevel.O0, perturb,
                                 order=1)]


@pytest.fixture
def perturbed() -> object:
    name = torchbridge.register_plugin(PerturbedBackend(), "perturbed")
    yield name
    torchbridge.unregister_plugin(name)


def test_validate_passes_identical_backends_and_fails_a_perturbed_one(perturbed: object
                                                                      ) -> None:
    x = torch.randn(8, 16)
    report = torchbridge.validate(model(), x, backends=["cpu", "example", "perturbed"])
    assert report.reference == "cpu"
    verdict = {r.backend: r.passed for r in report.results}
    assert verdict == {"cpu": True, "example": True, "perturbed": False}
    assert not report.passed
    bad = report.results[2].outputs[0]
    assert bad.max_rel_diff > report.tolerance and bad.shape == (8, 4)
    assert "FAIL perturbed" in report.summary()


def test_validate_reports_a_backend_that_cannot_run(no_cuda_reason: str) -> None:
    report = torchbridge.validate(model(), torch.randn(2, 16), backends=["cpu", "cuda"])
    assert [r.passed for r in report.results] == [True, False]
    assert no_cuda_reason in (report.results[1].error or "")
    with pytest.raises(ValueError, match="at least two backends"):
        torchbridge.validate(model(), torch.randn(2, 16), backends=["cpu"])
    # Compared with itself, a backend passed whatever it computed.
    cpu = torchbridge.get_backend("cpu")
    for twice in (["cpu", "cpu"], [cpu, cpu], ["cpu", "CPU:0"]):
        with pytest.raises(ValueError, match="a backend more than once"):
            torchbridge.validate(model(), torch.randn(2, 16), backends=twice)


def test_validate_cli_exit_status(perturbed: object, capsys: pytest.CaptureFixture[str]
                                  ) -> None:
    from torchbridge.cli import main

    assert main(["validate", "--model", "convnet", "--backends", "cpu,example"]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert main(["validate", "--backends", "cpu,perturbed", "--json"]) == 1
    assert '"passed": false' in capsys.readouterr().out


class _Perturbed:
    """A second "backend" for validate: the CPU backend with the output changed."""

    def __init__(self, change: Any) -> None:
        from torchbridge.backend import get_backend

        self.cpu = get_backend("cpu")
        self.name, self.device, self.change = "perturbed", self.cpu.device, change

    def to_device(self, x: Any) -> Any:
        return self.cpu.to_device(x)

    def prepare_model(self, model: Any, level: Any) -> Any:
        prepared = self.cpu.prepare_model(model, level)
        prepared.register_forward_hook(lambda module, args, out: self.change(out))
        return prepared


class _Returns(torch.nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> Any:
        return self.fn(x)


@pytest.mark.parametrize("make, change, x", [
    (lambda x: torch.complex(x, x), lambda o: torch.complex(o.real, o.imag + 100),
     torch.ones(3)),
    (lambda x: x.long() * 0 + 16777217, lambda o: o - 1, torch.ones(3)),
    (lambda x: torch.arange(50000) + x.long(), lambda o: o + 1, torch.zeros(1)),
    (lambda x: x.sum().item(), lambda o: o + 5, torch.ones(3)),
], ids=["complex-imaginary", "int64-past-float32", "ids-off-by-one", "python-number"])
def test_validate_sees_every_kind_of_output_differ(make: Any, change: Any,
                                                   x: torch.Tensor) -> None:
    """Each passed before: the imaginary part dropped, int64 compared in float32, ids
    under a relative tolerance, Python numbers not compared at all."""
    from torchbridge.backend import get_backend
    from torchbridge.validation import validate

    report = validate(_Returns(make), x, [get_backend("cpu"), _Perturbed(change)], level="O1")
    assert not report.passed, report.summary()
    assert str(report) == report.summary()
    json.dumps(report.to_dict(), allow_nan=False)  # strict JSON
