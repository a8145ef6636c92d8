"""What prepare_model says against what happened, at the edges a first user round found:
a model that writes to its input, a tokenizer's BatchEncoding as the sample, an output
object the checks cannot look into, a compiled forward that fails after prepare_model
returned, and a pass that leaves the output strided. Timing decisions here use an
injected timer: nothing depends on this machine's speed."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
import torchbridge
from kernel_declaring import RmsNormBlock
from torch import nn
from torchbridge.levels import OptimizationLevel
from torchbridge.optimize.passes import OptimizationPass
from torchbridge.optimize.pipeline import run_pipeline


def keep_prepared(label: str, fn: Any) -> float:
    """A timer under which the prepared model wins, as it does where it is faster."""
    fn()
    return {"O0": 1.0}.get(label, 0.1)


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.linear(x)


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_a_model_that_writes_its_input_is_checked_on_the_sample_and_leaves_it_alone(
        level: str) -> None:
    torch.manual_seed(0)
    model = WritesItsInput().eval()
    x = torch.ones(8, 16)
    expected = copy.deepcopy(model)(x.clone())
    result = run_pipeline(torchbridge.get_backend("cpu"), model, level, sample_input=x,
                          timer=keep_prepared)
    assert torch.equal(x, torch.ones(8, 16))  # the caller's sample, as it was
    assert not result.failed, result.summary()
    assert result.max_rel_diff is not None and result.max_rel_diff <= 0.05
    out = result.model(x.clone())
    torch.testing.assert_close(out.float(), expected, atol=0.05, rtol=0.05)


class Keywords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.linear(input_ids * attention_mask)


@pytest.mark.parametrize("mapping", [collections.UserDict, "BatchEncoding"])
def test_a_mapping_that_is_not_a_dict_is_keyword_arguments(mapping: Any) -> None:
    if mapping == "BatchEncoding":
        mapping = pytest.importorskip("transformers").BatchEncoding
    torch.manual_seed(0)
    model = Keywords().eval()
    ids, mask = torch.randn(2, 8), torch.ones(2, 8)
    sample = mapping({"input_ids": ids, "attention_mask": mask})
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=sample)
    assert result.max_rel_diff == 0.0
    torch.testing.assert_close(result.model(input_ids=ids, attention_mask=mask),
                               model(ids, mask))


class Out:
    """A model's own output class: neither a dataclass nor a dict."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class OpaqueOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 256), nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> Out:
        return Out(self.b(torch.relu(self.a(x))))


def test_an_output_the_checks_cannot_see_into_gets_no_unchecked_pass() -> None:
    torch.manual_seed(0)
    model, x = OpaqueOutput().eval(), torch.randn(8, 64)
    expected = model(x).logits
    result = run_pipeline(torchbridge.get_backend("cpu"), copy.deepcopy(model), "O2",
                          sample_input=x, timer=keep_prepared)
    changed = [p.name for p in result.applied if p.name != "device_placement"]
    assert changed == [], result.summary()
    assert any("holds no tensor the checks can see" in p.detail for p in result.failed)
    assert result.max_rel_diff is None
    assert any(n.startswith("outputs not checked") for n in result.notes)
    out = result.model(x).logits
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


def test_an_output_the_checks_cannot_see_into_fails_a_strict_run() -> None:
    model, x = OpaqueOutput().eval(), torch.randn(8, 64)
    with pytest.raises(torchbridge.ModelOptimizationError, match="holds no tensor"):
        run_pipeline(torchbridge.get_backend("cpu"), model, "O2", sample_input=x,
                     strict=True, timer=keep_prepared)


def test_at_o0_an_opaque_output_is_returned_unchanged_with_a_note() -> None:
    model, x = OpaqueOutput().eval(), torch.randn(8, 64)
    result = torchbridge.get_backend("cpu").optimize(model, "O0", sample_input=x)
    assert result.optimizations_applied == ["device_placement"]
    assert any(n.startswith("outputs not checked") for n in result.notes)


def test_a_compiled_forward_that_fails_later_is_reported_failed(
        reload_plugins: None) -> None:
    """A recompile (an input of another rank) that the compiler cannot build: the model runs
    uncompiled from then on, and the report no longer lists compile, or the compile
    options riding on it, as applied."""

    compiles: list[int] = []

    def breaks_on_other_shapes(gm: Any, example_inputs: Any) -> Any:
        compiles.append(len(example_inputs))
        if len(compiles) > 1:  # the sample's compile works; a recompile does not
            raise RuntimeError("the compiler broke on the new shape")
        return gm.forward

    class FlakyCompiler:
        @torchbridge.hookimpl(tryfirst=True)
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            def choose(model: nn.Module, ctx: Any) -> nn.Module:
                ctx.state["compile_backend"] = breaks_on_other_shapes
                return model
            return [OptimizationPass("flaky_compiler", "picks a compiler that breaks "
                                     "on recompiles", OptimizationLevel.O2, choose,
                                     order=70, mutates=False)]

    torchbridge.register_plugin(FlakyCompiler(), name="flaky_compiler")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile_value_check"]}))
    result = run_pipeline(backend, model, "O3", sample_input=torch.randn(4, 16),
                          timer=keep_prepared)
    assert "compile" in result.optimizations_applied, result.summary()
    riding = [name for name in result.compile_dependents
              if name in result.optimizations_applied]
    assert "inference_freezing" in riding
    with torch.no_grad():
        other = torch.randn(2, 3, 16)  # another rank: always a recompile
        torch.testing.assert_close(result.model(other).float(), model(other),
                                   atol=0.05, rtol=0.05)
    applied = result.optimizations_applied
    assert "compile" not in applied and not set(riding) & set(applied)
    record = next(p for p in result.passes if p.name == "compile")
    assert record.status == "failed" and "after prepare_model returned" in record.detail
    assert "compiler broke on the new shape" in result.summary()
    report = torchbridge.optimization_result(result.model)
    assert report is not None and "compile" not in report.optimizations_applied


def test_a_pass_that_leaves_outputs_strided_is_rolled_back(reload_plugins: None) -> None:
    """Same values, another layout: user code that views the output would raise."""
    from torchbridge.optimize.forward import install_forward

    class Transposes:
        @torchbridge.hookimpl
        def torchbridge_optimization_passes(self, backend: Any, level: Any
                                            ) -> list[OptimizationPass]:
            def strided(model: nn.Module, ctx: Any) -> nn.Module:
                install_forward(model, lambda inner: (
                    lambda *a, **k: inner(*a, **k).t().contiguous().t()))
                return model
            return [OptimizationPass("transposes", "returns its output column-major",
                                     OptimizationLevel.O1, strided, order=30)]

    torchbridge.register_plugin(Transposes(), name="transposes")
    model, x = nn.Linear(16, 8).eval(), torch.randn(4, 16)
    result = run_pipeline(torchbridge.get_backend("cpu"), model, "O1", sample_input=x)
    record = next(p for p in result.passes if p.name == "transposes")
    assert record.status == "failed" and "no longer contiguous" in record.detail
    assert result.model(x).view(-1).shape == (32,)


def test_torch_save_of_a_model_with_its_own_forward_says_what_to_do(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    backend = torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization={"disabled_passes": ["compile"]}))
    result = run_pipeline(backend, model, "O2", sample_input=torch.randn(4, 16),
                          timer=keep_prepared)
    assert "autocast" in result.optimizations_applied, result.summary()
    with pytest.raises(torchbridge.ModelOptimizationError, match="state_dict"):
        torch.save(result.model, tmp_path / "model.pt")
    torchbridge.save_checkpoint(result.model, tmp_path / "weights.pt")
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    fresh.load_state_dict(torchbridge.load_checkpoint(tmp_path / "weights.pt"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values(), strict=True))
    twin = copy.deepcopy(result.model)  # a deep copy is not a pickle: it still works
    torch.testing.assert_close(twin(torch.ones(2, 16)), result.model(torch.ones(2, 16)))


def test_a_state_dict_loaded_into_a_folded_model_runs_its_batchnorms() -> None:
    """Weights of the model as built (fine-tuned, say) loaded into the O1 model whose
    BatchNorm was folded: the BatchNorm runs again, so the outputs are the model's, and the
    report no longer lists the folding as applied. A checkpoint of the prepared model
    itself loads back to the same outputs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                          nn.Linear(288, 5))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    model.eval()
    x = torch.randn(4, 3, 8, 8)
    result = torchbridge.get_backend("cpu").optimize(model, "O1", sample_input=x)
    assert "conv_bn_folding" in result.optimizations_applied, result.summary()
    prepared = result.model
    own = copy.deepcopy(prepared.state_dict())
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)  # the weights change after preparing
        model[0].weight.mul_(1.5)
        expected = model(x)
        prepared.load_state_dict(model.state_dict())
        torch.testing.assert_close(prepared(x), expected, atol=1e-5, rtol=1e-5)
    assert "conv_bn_folding" not in result.optimizations_applied
    twin = copy.deepcopy(model)
    twin.load_state_dict(own)  # the prepared model's own checkpoint, in the class as built
    again = torchbridge.get_backend("cpu").optimize(copy.deepcopy(twin), "O1", sample_input=x)
    with torch.no_grad():
        torch.testing.assert_close(again.model(x), twin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("contract", [">=4,<5", "banana"])
def test_register_plugin_checks_the_contract_range(reload_plugins: None,
                                                   contract: str) -> None:
    """As an entry-point plugin outside its range is: recorded, never called."""
    from torchbridge.plugins import plugin_records

    called: list[int] = []

    class Future:
        TORCHBRIDGE_CONTRACT = contract

        @torchbridge.hookimpl
        def torchbridge_detect(self) -> Any:
            called.append(1)
            return None

    with pytest.raises(torchbridge.PluginError, match="not registered"):
        torchbridge.register_plugin(Future(), name="future")
    record = next(r for r in plugin_records() if r.name == "future")
    assert record.status == ("failed" if contract == "banana" else "incompatible")
    assert record.error
    torchbridge.list_backends()
    assert called == []


def test_doctor_lists_a_kernel_only_on_the_backends_it_serves(reload_plugins: None) -> None:
    from torchbridge import KernelImplementation, doctor

    class Kernels:
        @torchbridge.hookimpl
        def torchbridge_kernel_implementations(self, backend: Any) -> list[Any]:
            def same(x: torch.Tensor, weight: Any = None, eps: float = 1e-6) -> torch.Tensor:
                return x
            return [KernelImplementation(op="rms_norm", name="only_for_acme", forward=same,
                                         backends=("acme",)),
                    KernelImplementation(op="rms_norm", name="for_cpu", forward=same,
                                         backends=("cpu",))]

    torchbridge.register_plugin(Kernels(), name="kernels")
    kernels = doctor.collect()["contributions"]["kernels"]["kernels"]
    assert "rms_norm:for_cpu on cpu" in kernels
    assert not [k for k in kernels if "only_for_acme" in k or "for_cpu on example" in k]


def test_the_final_check_is_a_stage_only_where_it_ran() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    backend = torchbridge.get_backend("cpu")
    without = backend.optimize(copy.deepcopy(model), "O1")
    assert "final_check" not in without.stage_seconds and without.max_rel_diff is None
    checked = backend.optimize(copy.deepcopy(model), "O1", sample_input=torch.randn(4, 16))
    assert "final_check" in checked.stage_seconds and checked.max_rel_diff is not None


def test_a_detection_that_answers_after_its_deadline_is_taken_by_a_rescan(
        reload_plugins: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hook past the deadline was never asked again, and its late answer never taken: a
    TPU runtime that started in 6 s on a busy machine was lost to the process for good.
    Deterministic: the hook waits on an event the test sets after the deadline passed."""
    import threading

    from torchbridge.plugins import plugin_records

    release, calls = threading.Event(), []

    class Slow:
        @torchbridge.hookimpl
        def torchbridge_detect(self) -> Any:
            calls.append(1)
            release.wait(60)
            return torchbridge.Detection("slowpoke", True, -40, "cpu", 1, "Slow", None, ("cpu",))

    monkeypatch.setenv("TORCHBRIDGE_DETECT_TIMEOUT", "0.05")
    torchbridge.register_plugin(Slow(), name="slow")
    statuses = {s.name: s for s in torchbridge.list_backends(rescan=True)}
    assert "slowpoke" not in statuses
    record = next(r for r in plugin_records() if r.name == "slow")
    assert record.detect_timed_out and record.status == "error"
    # Still running: a rescan answers with the same error at once, without asking again.
    torchbridge.list_backends(rescan=True)
    assert calls == [1] and record.detect_timed_out
    release.set()
    for thread in threading.enumerate():
        if thread.name == "torchbridge torchbridge_detect slow":
            thread.join(10)
    statuses = {s.name: s for s in torchbridge.list_backends(rescan=True)}
    assert statuses["slowpoke"].available and calls == [1]
    record = next(r for r in plugin_records() if r.name == "slow")
    assert not record.detect_timed_out and record.status == "loaded" and not record.errors


def test_a_kernel_substitution_undone_after_timing_is_not_reported_substituted(
        reload_plugins: None) -> None:
    """The timing kept O0 (or a final check undid the pass): the modules run their own code
    again, and the report's kernel lines said "substituted" all the same."""
    from torchbridge import KernelImplementation

    def rms(x: torch.Tensor, weight: Any = None, eps: float = 1e-6) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out if weight is None else out * weight.float()).to(x.dtype)

    class Kernels:
        @torchbridge.hookimpl
        def torchbridge_kernel_implementations(self, backend: Any) -> list[Any]:
            return [KernelImplementation(op="rms_norm", name="exact_rms", forward=rms,
                                         backends=("cpu",), traceable=True, priority=10)]

    def o0_is_fastest(label: str, call: Any) -> float:
        call()
        return 1.0 if label == "O0" else 2.0

    torchbridge.register_plugin(Kernels(), name="exact_kernels")
    config = torchbridge.TorchBridgeConfig(optimization={"disabled_passes": [
        "compile", "autocast", "low_precision_weights"]})
    backend = torchbridge.get_backend("cpu", config)
    torch.manual_seed(0)
    result = run_pipeline(backend, RmsNormBlock().eval(), "O3", sample_input=torch.randn(8, 64),
                          timer=o0_is_fastest)
    assert type(result.model.norm) is nn.RMSNorm  # O0 kept: the module's own code
    lines = {line["module"]: line for line in result.kernel_substitutions}
    assert lines["norm"]["status"] == "undone", lines
    assert "was exact_rms (plugin exact_kernels)" in lines["norm"]["detail"]
    assert "kernel: norm (rms_norm): undone" in result.summary()
