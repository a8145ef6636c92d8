"""The prepare_model pass pipeline: plugin passes (torchbridge_optimization_passes), vetoes,
rollback of failing passes, strict mode, and the report."""

from __future__ import annotations

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge import OptimizationLevel, OptimizationPass, TorchBridgeConfig


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def backend_with(**example: object) -> torchbridge.Backend:
    return torchbridge.get_backend("cpu", TorchBridgeConfig(hardware={"example": example}))


def test_third_party_pass_applies_when_its_precondition_holds() -> None:
    result = backend_with(tag_models=True).optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "example_tag")
    assert record.status == "applied" and record.plugin == "example"
    assert result.model.tagged_by_example is True
    off = backend_with(tag_models=False).optimize(mlp(), "O1")
    record = next(p for p in off.passes if p.name == "example_tag")
    assert record.status == "skipped" and "tag_models is off" in record.detail


def test_pass_below_its_level_is_skipped_with_reason() -> None:
    result = backend_with(tag_models=True).optimize(mlp(), "O0")
    record = next(p for p in result.passes if p.name == "example_tag")
    assert record.status == "skipped" and "below this pass's O1" in record.detail
    assert not hasattr(result.model, "tagged_by_example")


def test_a_plugin_can_veto_a_pass() -> None:
    result = backend_with(veto_pass="device_placement").optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "device_placement")
    assert record.status == "skipped"
    assert record.detail == "vetoed by plugin example: the example plugin says no"


def test_config_can_disable_a_pass() -> None:
    cfg = TorchBridgeConfig(optimization={"disabled_passes": ["example_tag"]},
                            hardware={"example": {"tag_models": True}})
    result = torchbridge.get_backend("cpu", cfg).optimize(mlp(), "O1")
    record = next(p for p in result.passes if p.name == "example_tag")
    assert record.status == "skipped" and "disabled by config" in record.detail


class Saboteur:
    """A pass that damages the model, then raises: the pipeline must roll it back."""

    @torchbridge.hookimpl(tryfirst=True)
    def torchbridge_optimization_passes(self, backend: torchbridge.Backend,
                                        level: OptimizationLevel) -> list[OptimizationPass]:
        def wreck(model: nn.Module, ctx: object) -> nn.Module:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            raise RuntimeError("kernel cache corrupted")

        return [OptimizationPass("saboteur", "wrecks weights", OptimizationLevel.O1, wreck,
                                 order=20)]


def test_failing_pass_is_rolled_back_and_reported(reload_plugins: None) -> None:
    torchbridge.register_plugin(Saboteur(), name="saboteur")
    model = mlp()
    x = torch.randn(3, 8)
    expected = model(x)
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x)
    record = next(p for p in result.passes if p.name == "saboteur")
    assert record.status == "failed" and "kernel cache corrupted" in record.detail
    torch.testing.assert_close(result.model(x), expected)
    assert result.max_abs_diff == 0.0
    with pytest.raises(torchbridge.ModelOptimizationError, match="saboteur"):
        torchbridge.get_backend("cpu").optimize(model, "O1", strict=True)
    torch.testing.assert_close(model(x), expected)  # the user's model was never touched


def test_eval_only_pass_never_touches_a_training_model(reload_plugins: None) -> None:
    class EvalOnly:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: object, level: object
                                            ) -> list[OptimizationPass]:
            return [OptimizationPass("freeze_everything", "eval only", OptimizationLevel.O1,
                                     lambda m, c: m, mode="inference")]

    torchbridge.register_plugin(EvalOnly(), name="eval_only")
    result = torchbridge.get_backend("cpu").optimize(mlp().train(), "O3")
    record = next(p for p in result.passes if p.name == "freeze_everything")
    assert record.status == "skipped" and "training mode" in record.detail


def test_inplace_mutates_the_given_model_and_default_does_not() -> None:
    backend = backend_with(tag_models=True)
    model = mlp()
    backend.prepare_model(model, "O1")
    assert not hasattr(model, "tagged_by_example")
    prepared = backend.prepare_model(model, "O1", inplace=True)
    assert prepared is model or getattr(model, "tagged_by_example", False)


def test_measure_reports_real_timings() -> None:
    x = torch.randn(64, 8)
    result = torchbridge.get_backend("cpu").optimize(mlp(), "O1", sample_input=x, measure=True)
    assert result.baseline_seconds and result.baseline_seconds > 0
    assert result.optimized_seconds and result.optimized_seconds > 0
    assert result.speedup == pytest.approx(result.baseline_seconds / result.optimized_seconds)
    assert "measured speedup" in result.summary()
    with pytest.raises(torchbridge.ModelOptimizationError, match="sample_input"):
        torchbridge.get_backend("cpu").optimize(mlp(), "O1", measure=True)
