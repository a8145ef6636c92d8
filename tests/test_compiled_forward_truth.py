"""What the report says of the compiled forward against what runs, after prepare_model
returned: weights changed under inductor freezing (a load_state_dict, an in-place write)
and a forward that dynamo compiled again and again until its recompile limit. Timing
decisions use an injected timer: nothing depends on this machine's speed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchbridge
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.forward import compile_state, compiled_forward
from torchbridge.optimize.passes import OptimizationPass
from torchbridge.optimize.pipeline import run_pipeline


def keep_prepared(label: str, fn: Any) -> float:
    """A timer under which the prepared model wins, as it does where it is faster."""
    fn()
    return {"O0": 1.0}.get(label, 0.1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def other_weights(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    other = type(model)().eval()
    with torch.no_grad():
        for name, t in other.named_buffers():
            if t.is_floating_point():
                t.uniform_(0.5, 1.5) if name.endswith("var") else t.normal_()
    return other.state_dict()


def test_weights_loaded_after_freezing_are_used_and_compile_is_reported_undone() -> None:
    """Inductor freezing compiled the weights into the graph: a load_state_dict after
    preparing was taken in part (new biases, old weights), while the report still listed
    freezing and compile as applied. Now the model runs its forward uncompiled, reading
    the weights loaded, and the report says why."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(8, 16)
    result = run_pipeline(torchbridge.get_backend("cpu"), model, "O3", sample_input=x,
                          timer=keep_prepared)
    assert {"inference_freezing", "compile"} <= set(result.optimizations_applied), \
        result.summary()
    assert "inference_freezing" in result.compile_dependents
    prepared = result.model
    new = other_weights(model)
    prepared.load_state_dict(new)
    expected = copy.deepcopy(model)
    expected.load_state_dict(new)
    with torch.no_grad():
        torch.testing.assert_close(prepared(x).float(), expected(x), atol=0.05, rtol=0.05)
    report = torchbridge.optimization_result(prepared)
    assert report is not None
    applied = report.optimizations_applied
    assert "compile" not in applied and "inference_freezing" not in applied, \
        report.summary()
    record = {p.name: p for p in report.passes}
    for name in ("compile", "inference_freezing"):
        assert record[name].status == "skipped"
        assert "after prepare_model returned" in record[name].detail
        assert "inductor freezing" in record[name].detail
        assert "a.weight" in record[name].detail


def _frozen(model: nn.Module) -> Any:
    """The model's forward compiled by inductor with freezing, as the O3 passes do on a
    CPU: the weights become constants of the graph at its first call."""
    return compiled_forward(model, lambda fn: torch.compile(fn), {"freezing": True})


def _scale(model: nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def _new_data(model: nn.Module) -> None:
    model.a.weight.data = model.a.weight.detach() * -1.0


class ConvNet(nn.Module):
    """Inductor freezing folds the BatchNorm's statistics into the convolution's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.norm = nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


def _statistics(model: nn.Module) -> None:
    with torch.no_grad():
        model.norm.running_mean.add_(3.0)


@pytest.mark.parametrize(("build", "change", "shape"), [
    (Net, _scale, (4, 16)), (Net, _new_data, (4, 16)), (ConvNet, _statistics, (2, 3, 8, 8))],
    ids=["in-place write", ".data replaced", "buffer written"])
def test_a_frozen_compiled_forward_is_left_once_its_weights_change(
        build: Callable[[], nn.Module], change: Callable[[nn.Module], None],
        shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = build().eval()
    expected = copy.deepcopy(model)
    state = _frozen(model)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected(x))  # compiled: the weights frozen
        assert model(x) is not None  # a second call: nothing changed, still compiled
        assert getattr(state, "stale", None) is None and state.error is None
        change(model)
        change(expected)
        torch.testing.assert_close(model(x), expected(x))
    assert state.stale is not None and "changed after it compiled" in state.stale


def test_a_tensor_replaced_in_its_slot_is_frozen_anew_and_watched() -> None:
    """Dynamo guards each tensor: a new one in its slot makes the forward compile again,
    freezing it; an in-place write to it later is a change like any other."""
    torch.manual_seed(0)
    model = Net().eval()
    expected = copy.deepcopy(model)
    state = _frozen(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        model(x)
        weight = torch.randn(32, 16)
        model.a.weight = nn.Parameter(weight.clone())
        expected.a.weight = nn.Parameter(weight.clone())
        torch.testing.assert_close(model(x), expected(x))
        assert getattr(state, "stale", None) is None  # compiled again, not left
        model.a.weight.mul_(-1.0)
        expected.a.weight.mul_(-1.0)
        torch.testing.assert_close(model(x), expected(x))
    assert state.stale is not None and "a.weight" in state.stale


class Counts(nn.Module):
    """A forward that updates a buffer of its own, as a running statistic would."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("with_sample", [True, False], ids=["sample", "first call"])
def test_prepare_models_checks_and_the_forwards_own_writes_leave_it_compiled(
        with_sample: bool) -> None:
    """prepare_model's checks put the buffers back after their calls (a write), with and
    without a sample input (the first call's timing replays it); the forward updates a
    buffer itself: none of that is a change of the weights it froze."""
    torch.manual_seed(0)
    model = Counts().eval()
    x = torch.randn(4, 16)
    result = run_pipeline(torchbridge.get_backend("cpu"), model, "O3",
                          sample_input=x if with_sample else None, timer=keep_prepared)
    prepared = result.model
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(prepared(x).float(), model(x), atol=0.05, rtol=0.05)
    state = compile_state(prepared)
    assert state is not None and state.error is None
    assert getattr(state, "stale", None) is None  # (a guard: it held before the watch)
    assert {"inference_freezing", "compile"} <= set(result.optimizations_applied), \
        result.summary()
    assert int(prepared.calls) == int(model.calls) == 3


def _compiler_plugin(compiler: Callable[..., Any]) -> None:
    class Compiler:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            def choose(model: nn.Module, ctx: Any) -> nn.Module:
                ctx.state["compile_backend"] = compiler
                return model
            return [OptimizationPass("counting_compiler", "picks a compiler that counts "
                                     "its graphs", OptimizationLevel.O2, choose,
                                     order=70, mutates=False)]

    torchbridge.register_plugin(Compiler(), name="counting_compiler")


class Steps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        return self.linear(x) * 2


def test_a_forward_counting_its_calls_in_an_int_attribute_is_reported_uncompiled(
        reload_plugins: None) -> None:
    """Dynamo specializes the graph on an int attribute: each training step compiled the
    forward again, until dynamo's recompile limit (8), and it ran uncompiled (eager) from
    then on, while the report still listed compile as applied."""
    graphs: list[int] = []

    def counting(gm: Any, example_inputs: Any) -> Any:
        graphs.append(len(example_inputs))
        return gm.forward

    _compiler_plugin(counting)
    torch.manual_seed(0)
    model = Steps().train()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["autocast"]}))
    x = torch.randn(4, 16)
    result = run_pipeline(backend, model, "O2", sample_input=x, timer=keep_prepared)
    assert "compile" in result.optimizations_applied, result.summary()
    prepared = result.model
    eager = copy.deepcopy(model)
    for _ in range(12):
        torch.testing.assert_close(prepared(x), eager(x))
    assert prepared.step == eager.step
    import torch._dynamo.config as dynamo_config

    limit = dynamo_config.recompile_limit
    assert len(graphs) == limit  # then no more: the calls after run eager
    report = torchbridge.optimization_result(prepared)
    assert report is not None and "compile" not in report.optimizations_applied, \
        report.summary()
    record = next(p for p in report.passes if p.name == "compile")
    assert record.status == "failed" and "after prepare_model returned" in record.detail
    assert f"recompile_limit = {limit}" in record.detail
    assert "int attribute" in record.detail and "eager" in record.detail


def test_a_compiled_forward_at_the_recompile_limit_is_reported_failed(
        reload_plugins: None) -> None:
    """Each input of another rank is a graph of its own: at dynamo's recompile limit (2
    here), calls that match none of the graphs run uncompiled, and the report says so."""
    import torch._dynamo.config as dynamo_config

    _compiler_plugin(lambda gm, example_inputs: gm.forward)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["autocast"]}))
    with dynamo_config.patch(recompile_limit=2):
        result = run_pipeline(backend, model, "O2", sample_input=torch.randn(4, 16),
                              timer=keep_prepared)
        assert "compile" in result.optimizations_applied, result.summary()
        with torch.no_grad():
            for shape in [(2, 3, 16), (2, 2, 3, 16), (2, 2, 2, 3, 16)]:
                x = torch.randn(shape)
                torch.testing.assert_close(result.model(x), model(x))
        report = torchbridge.optimization_result(result.model)
        assert report is not None and "compile" not in report.optimizations_applied, \
            report.summary()
    record = next(p for p in report.passes if p.name == "compile")
    assert record.status == "failed"
    assert "after prepare_model returned" in record.detail
    assert "recompile_limit = 2" in record.detail and "eager" in record.detail


def test_jit_trace_of_the_prepared_model_leaves_it_compiled() -> None:
    """torch.jit.trace of a model prepared with compile traced the compiled call, which
    failed there; its error turned compile off for every later call of the model, and the
    report said compile failed at a call. Under tracing the forward runs uncompiled now."""
    torch.manual_seed(0)
    model = Net().eval()
    x = torch.randn(8, 16)
    result = run_pipeline(torchbridge.get_backend("cpu"), model, "O3", sample_input=x,
                          timer=keep_prepared)
    prepared = result.model
    assert "compile" in result.optimizations_applied, result.summary()

    with torch.no_grad():
        traced = torch.jit.trace(prepared, x)
        expected, out = prepared(x), traced(x)

    state = compile_state(prepared)
    assert state is not None and state.error is None
    assert "compile" in [p.name for p in result.applied]
    assert float((out - expected).abs().max() / expected.abs().max()) < 3e-2
