"""prepare_model's invariants, each from a failure found on the pipeline: the prepared model
is a drop-in (outputs, types, attributes, hooks, ties, state_dict keys), nothing of the
caller's is lost (inplace rollback, RNG, buffers, no process-wide patching), and what the
report claims was checked on the sample input."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

import pytest
import torch
import torchbridge
from hang_bounds import HANG_S
from torch import nn
from torchbridge import OptimizationLevel, OptimizationPass, trees
from torchbridge.models import reference_models
from torchbridge.optimize.forward import compiled_forward
from torchbridge.optimize.measure import output_drift

LEVELS = ["O0", "O1", "O2", "O3"]
NO_COMPILE = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": ["compile"]})


def cpu(config: torchbridge.TorchBridgeConfig | None = None) -> torchbridge.Backend:
    return torchbridge.get_backend("cpu", config or NO_COMPILE)


class ConvBN(nn.Module):
    """A conv+BN model with an attribute, a method, and a forward torch.fx cannot trace."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8))
        self.head = nn.Linear(8, 4)
        self.labels = ["a", "b", "c", "d"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        if h.sum() > -1e9:  # data-dependent control flow: torch.fx cannot trace this
            h = h.relu()
        out: torch.Tensor = self.head(h.mean(dim=(2, 3)))
        return out

    def top_label(self, x: torch.Tensor) -> str:
        return self.labels[int(self(x).argmax(dim=-1)[0])]


def trained_bn(model: nn.Module) -> nn.Module:
    """Give BatchNorms non-trivial running statistics, then eval."""
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 8, 8))
    return model.eval()


@pytest.mark.parametrize("level", LEVELS)
def test_conv_bn_model_keeps_attributes_methods_and_hooks(level: str) -> None:
    torch.manual_seed(0)
    model = trained_bn(ConvBN())
    x = torch.randn(2, 3, 8, 8)
    fired: list[int] = []
    model.register_forward_hook(lambda m, a, out: fired.append(1))
    expected = model(x)
    fired.clear()
    result = cpu().optimize(model, level, sample_input=x)
    prepared = result.model
    assert type(prepared) is ConvBN and prepared.labels == model.labels
    assert prepared.top_label(x) == model.top_label(x)
    fired.clear()
    out = prepared(x)
    assert fired == [1] and out.dtype == torch.float32
    assert (out - expected).abs().max() / expected.abs().max() <= \
        torchbridge.levels.LEVEL_TOLERANCE[level]
    assert list(prepared.state_dict()) == list(model.state_dict())
    if level != "O0":
        assert [p.status for p in result.passes if p.name == "conv_bn_folding"] == ["applied"]


def test_no_process_wide_patching_while_folding() -> None:
    """torch.fx's fuse patched nn.Module.__call__ for the process while tracing; inference
    in other threads crashed. Folding now traces with hooks and a thread-local mode."""
    call_before = nn.Module.__call__
    seen: list[Any] = []
    stop, inferring = threading.Event(), threading.Event()
    other = nn.Linear(4, 4)

    def infer() -> None:
        while not stop.is_set():
            seen.append(nn.Module.__call__)
            other(torch.randn(1, 4))
            inferring.set()

    thread = threading.Thread(target=infer)
    thread.start()
    # The other thread is inferring before folding starts, however the threads are
    # scheduled (a hang catcher only: it sets this after its first call).
    assert inferring.wait(HANG_S)
    try:
        for _ in range(3):
            cpu().optimize(trained_bn(ConvBN()), "O1", sample_input=torch.randn(2, 3, 8, 8))
    finally:
        stop.set()
        thread.join()
    assert seen and all(c is call_before for c in seen)


def test_inplace_failed_pass_leaves_the_callers_model_exactly_as_it_was(
        reload_plugins: None) -> None:
    class HalfDone:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            def wreck(model: nn.Module, ctx: Any) -> nn.Module:
                with torch.no_grad():
                    model[0].weight.mul_(0)
                model[0] = nn.Identity()
                model.extra = "left behind"
                model[1].__class__ = nn.Tanh
                raise RuntimeError("half way")
            return [OptimizationPass("half_done", "fails half way", OptimizationLevel.O1,
                                     wreck, order=20)]

    torchbridge.register_plugin(HalfDone(), name="half_done")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    first, weight = model[0], model[0].weight
    saved = weight.detach().clone()
    x = torch.randn(3, 4)
    expected = model(x)
    result = cpu().optimize(model, "O1", inplace=True, sample_input=x)
    assert [p.status for p in result.passes if p.name == "half_done"] == ["failed"]
    assert result.model is model and model[0] is first and model[0].weight is weight
    assert torch.equal(weight, saved) and type(model[1]) is nn.ReLU
    assert not hasattr(model, "extra")
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)


def test_optimize_leaves_global_rng_and_buffers_of_a_training_model_alone() -> None:
    torch.manual_seed(0)
    model = ConvBN().train()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    x = torch.randn(2, 3, 8, 8)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    cpu().optimize(model, "O3", sample_input=x, inplace=True)
    assert torch.equal(torch.rand(3), expected_next)
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert model.training


def test_float64_model_keeps_float64_at_o3() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double().eval()
    x = torch.randn(3, 8, dtype=torch.float64)
    result = cpu().optimize(model, "O3", sample_input=x)
    reasons = {p.name: p.detail for p in result.skipped}
    assert "float64" in reasons["autocast"]
    assert reasons["low_precision_weights"] == "autocast did not run"
    assert not result.failed
    out = result.model(x)
    assert out.dtype == torch.float64 and all(p.dtype == torch.float64
                                              for p in result.model.parameters())


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.body(self.embed(ids))))
        return out


def test_o3_keeps_tied_weights_tied() -> None:
    torch.manual_seed(0)
    model = TiedLM().eval()
    ids = torch.randint(0, 50, (2, 5))
    prepared = cpu(torchbridge.TorchBridgeConfig(
        precision="bfloat16", optimization={"disabled_passes": ["compile"]})).prepare_model(
        model, "O3", sample_input=ids)
    assert prepared.head.weight is prepared.embed.weight
    assert sum(p.numel() for p in prepared.parameters()) == \
        sum(p.numel() for p in model.parameters())
    assert list(prepared.state_dict()) == list(model.state_dict())
    assert prepared.body.weight.dtype == torch.bfloat16  # untied weights still cast
    assert prepared(ids).dtype == torch.float32


Pair = collections.namedtuple("Pair", "logits hidden")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    score: float
    extra: dict[str, torch.Tensor]


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.lin(x)
        if self.kind == "namedtuple":
            return Pair(h, [h * 2, {"x": h.sum()}])
        return Output(h, float(h.sum()), {"h": h})


@pytest.mark.parametrize("kind", ["namedtuple", "dataclass"])
@pytest.mark.parametrize("level", ["O1", "O3"])
def test_output_structures_come_back_as_they_were(kind: str, level: str) -> None:
    torch.manual_seed(0)
    model = Structured(kind).eval()
    x = torch.randn(4, 8)
    config = torchbridge.TorchBridgeConfig(precision="bfloat16",
                                           optimization={"disabled_passes": ["compile"]})
    result = cpu(config).optimize(model, level, sample_input=x)
    out = result.model(x)
    assert type(out) is (Pair if kind == "namedtuple" else Output)
    tensors = trees.tensors(out)
    assert tensors and all(t.dtype == torch.float32 for t in tensors)
    if level == "O3":
        assert [p.status for p in result.passes if p.name == "autocast"] == ["applied"]
        assert result.max_rel_diff is not None and result.max_rel_diff > 0


def test_drift_sees_dataclass_fields_and_python_numbers() -> None:
    t = torch.ones(2)
    assert output_drift(Output(t, 1.0, {"h": t}), Output(t, 1.5, {"h": t}))[0] == 0.5
    assert output_drift(Output(t, 1.0, {"h": t}), Output(t, 1.0, {"h": t * 3}))[0] == 2.0
    with pytest.raises(ValueError, match="structure"):
        output_drift({"a": t}, {"b": t})
    with pytest.raises(ValueError, match="dtype"):
        output_drift(t, t.bfloat16())


_INF, _NAN = float("inf"), float("nan")


@pytest.mark.parametrize(("reference", "candidate", "expected"), [
    ([1.0, -4.0, 2.0], [1.5, -4.0, 2.0], (0.5, 0.125)),  # finite: the two-reduction path
    ([0.0, 0.0], [0.0, 0.25], (0.25, 0.25)),  # a zero reference: the absolute figure
    ([1.0, _NAN, 2.0], [1.5, _NAN, 2.0], (0.5, 0.25)),  # NaN in both: no difference
    ([1.0, _INF, 2.0], [1.0, _INF, 3.0], (1.0, 0.5)),  # the scale from finite values only
    ([1.0, 2.0], [1.0, _NAN], (_INF, _INF)),  # NaN in the candidate only
    ([1.0, 2.0], [-_INF, 2.0], (_INF, _INF)),  # an infinity in the candidate only
    ([1.0, -_INF], [1.0, _INF], (_INF, _INF)),  # infinities of opposite signs
    ([1.0, _INF], [1.0, 2.0], (_INF, _INF)),  # an infinity in the reference only
    ([1.0, _NAN], [1.0, 2.0], (_INF, _INF)),  # NaN in the reference only
    ([3e38, 1.0], [-3e38, 1.0], (_INF, _INF)),  # a difference beyond float32
])
def test_drift_of_tensors_with_and_without_nan_and_infinities(
        reference: list[float], candidate: list[float], expected: tuple[float, float]
        ) -> None:
    from torchbridge.optimize.measure import tensor_drift

    for dtype in (torch.float32, torch.bfloat16):
        ref, cand = torch.tensor(reference, dtype=dtype), torch.tensor(candidate, dtype=dtype)
        if dtype == torch.bfloat16 and 3e38 in reference:
            continue  # bfloat16's range reaches 3e38: the case is float32's
        assert tensor_drift(ref, cand) == pytest.approx(expected), dtype


def test_a_model_that_cannot_be_deep_copied() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    model.lock = threading.Lock()  # deepcopy raises on locks
    with pytest.raises(torchbridge.ModelOptimizationError, match=r"deep-copied.*inplace=True"):
        cpu().prepare_model(model, "O1")
    assert cpu().prepare_model(model, "O1", inplace=True) is model


def test_a_forward_that_raises_gets_a_clear_error() -> None:
    with pytest.raises(torchbridge.ModelOptimizationError, match="raised on the sample input"):
        cpu().optimize(nn.Linear(4, 4), "O1", sample_input=torch.randn(2, 5), strict=True)


def failing_backend(gm: Any, example_inputs: Any) -> Any:
    raise RuntimeError("the compiler broke")


def test_compile_error_without_sample_falls_back_once_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    expected = model(x)
    state = compiled_forward(model, lambda fn: torch.compile(fn, backend=failing_backend))
    with caplog.at_level(logging.WARNING, logger="torchbridge"):
        torch.testing.assert_close(model(x), expected)
        torch.testing.assert_close(model(x), expected)
    assert state.error is not None and "compiler broke" in str(state.error)
    assert sum("runs uncompiled" in r.message for r in caplog.records) == 1
    with pytest.raises(RuntimeError):  # the model's own error is not hidden
        model(torch.randn(2, 5))


def test_compile_error_with_sample_input_surfaces_inside_prepare_model(
        reload_plugins: None) -> None:
    class BrokenCompiler:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            def choose(model: nn.Module, ctx: Any) -> nn.Module:
                ctx.state["compile_backend"] = failing_backend
                return model
            return [OptimizationPass("broken_compiler", "picks a failing compiler",
                                     OptimizationLevel.O2, choose, order=70, mutates=False)]

    torchbridge.register_plugin(BrokenCompiler(), name="broken_compiler")
    model = nn.Linear(4, 4).eval()
    x = torch.randn(2, 4)
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile_value_check"]}))
    result = backend.optimize(model, "O2", sample_input=x)
    record = next(p for p in result.passes if p.name == "compile")
    assert record.status == "failed" and "compiler broke" in record.detail
    assert "forward" not in result.model.__dict__ or result.model(x).dtype == torch.float32
    with pytest.raises(torchbridge.ModelOptimizationError, match="compile"):
        backend.optimize(model, "O2", sample_input=x, strict=True)


@pytest.mark.parametrize("level", LEVELS)
def test_reference_models_keep_callers_model_rng_and_output_type(level: str) -> None:
    for ref in reference_models(scale=0.25):
        torch.manual_seed(0)
        model, x = ref.build().eval(), ref.make_input(2)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        expected = model(x)
        prepared = cpu().prepare_model(model, level, sample_input=x)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        out = prepared(x)
        assert type(out) is type(expected) and out.dtype == expected.dtype
        assert type(prepared) is type(model)


def test_compiled_path_serves_calls_shaped_like_the_first() -> None:
    """generate() calls forward with a KV cache and growing shapes: those calls run the
    uncompiled forward; calls like the sample input's stay compiled."""

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return x * 2 if scale is None else x * scale

    compiled_calls: list[int] = []

    def fake_compile(fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            compiled_calls.append(1)
            return fn(*args, **kwargs)
        return run

    model = Scaled()
    compiled_forward(model, fake_compile)
    x = torch.ones(2)
    assert torch.equal(model(x), x * 2) and len(compiled_calls) == 1
    assert torch.equal(model(x, scale=torch.tensor(3.0)), x * 3) and len(compiled_calls) == 1
    assert torch.equal(model(x, scale=None), x * 2) and len(compiled_calls) == 2


def test_a_call_of_another_signature_is_logged_once_as_uncompiled(
        caplog: pytest.LogCaptureFixture) -> None:
    """A user whose calls pass other keywords than the sample input is told, once for each
    such signature, that they run uncompiled, with both signatures."""

    class Scaled(nn.Module):
        def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
            return x * 2 if scale is None else x * scale

    model = Scaled()
    state = compiled_forward(model, lambda fn: fn)
    x = torch.ones(2)
    model(x)
    with caplog.at_level(logging.INFO, logger="torchbridge.optimize.forward"):
        for _ in range(3):
            model(x, scale=torch.tensor(3.0))
        model(x=x)
    messages = [r.getMessage() for r in caplog.records if "runs uncompiled" in r.getMessage()]
    assert messages == [
        "Scaled called with 1 positional argument(s) and keywords ['scale']: it runs "
        "uncompiled (compiled for 1 positional argument(s) and keywords none)",
        "Scaled called with 0 positional argument(s) and keywords ['x']: it runs "
        "uncompiled (compiled for 1 positional argument(s) and keywords none)"]
    assert state.uncompiled_signatures == {(1, frozenset({"scale"})), (0, frozenset({"x"}))}


def test_the_compile_note_says_which_calls_run_uncompiled() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    prepared = cpu(torchbridge.TorchBridgeConfig()).prepare_model(
        model, "O2", sample_input=torch.randn(2, 8))
    notes = torchbridge.optimization_result(prepared).notes
    assert any(n.startswith("compile:") and "other keywords" in n and "run the forward "
               "uncompiled" in n for n in notes)


def test_a_deep_copy_of_a_prepared_model_runs_its_own_weights() -> None:
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    config = torchbridge.TorchBridgeConfig(precision="bfloat16",
                                           optimization={"disabled_passes": ["compile"]})
    prepared = cpu(config).prepare_model(model, "O2", sample_input=x)
    before = prepared(x)
    twin = copy.deepcopy(prepared)
    with torch.no_grad():
        twin[2].bias.add_(10.0)
    assert torch.equal(prepared(x), before)  # the original is not the copy's forward
    out = twin(x)
    assert out.dtype == torch.float32 and (out - before).min() > 9  # the copy's weights
    assert type(twin) is nn.Sequential and list(twin.state_dict()) == list(model.state_dict())


@dataclasses.dataclass
class Fresh:
    """An output type only the test below returns: pytree meets it there first."""

    logits: torch.Tensor
    extra: dict[str, torch.Tensor]


@pytest.mark.parametrize("with_sample", [True, False])
def test_compiled_autocast_model_keeps_new_output_types_in_one_graph(with_sample: bool
                                                                     ) -> None:
    """O3 compiles the autocast forward with its cast back to float32. An output type
    pytree does not know yet (Fresh, never walked before) is registered
    outside the compiled region, and the model still compiles and runs compiled; once it is
    known, the cast is traced with the model: one compiled graph, no break at its end."""
    from torch._dynamo.utils import counters
    from torchbridge.optimize.forward import compile_state

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Fresh:
            h = self.lin(x)
            return Fresh(h, {"h": h.relu()})

    torch.manual_seed(0)
    torch._dynamo.reset()
    counters.clear()
    model, x = Model().eval(), torch.randn(4, 8)
    expected = model(x)
    config = torchbridge.TorchBridgeConfig(precision="bfloat16")
    result = cpu(config).optimize(model, "O3", sample_input=x if with_sample else None)
    with torch.no_grad():
        out = result.model(x)
        out = result.model(x)
    assert type(out) is Fresh
    assert all(t.dtype == torch.float32 for t in trees.tensors(out))
    torch.testing.assert_close(out.logits, expected.logits, rtol=2e-2, atol=2e-2)
    state = compile_state(result.model)
    assert state is not None and state.error is None
    if with_sample:
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()
