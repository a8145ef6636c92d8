"""prepare_model(quantize=...): torchao quantization of the Linear layers where the device
runs the mode, kept only when the prepared model keeps the accuracy gate against O0 on the
sample input; the report gives the mode and the figures, or why not. The CPU's ISA comes
from the fake /proc/cpuinfo of tests/test_cpu_isa.py, so these tests decide the same on
any host; those that quantize need torchao (skipped without it, with the reason)."""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torchbridge
from test_cpu_isa import CPUINFO
from torch import nn
from torchbridge.builtin.cpu import host
from torchbridge.cpu_features import canonical_flag
from torchbridge.errors import ConfigurationError
from torchbridge.optimize.quantize_gate import accuracy, unsupported
from torchbridge.types import DeviceInfo

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None,
    reason="torchao is not installed (pip install torchbridge-core[quantize])")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                         nn.Linear(128, 16)).eval()


def _sample() -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def _backend(**optimization: Any) -> Any:
    return torchbridge.get_backend("cpu", torchbridge.TorchBridgeConfig(
        optimization=optimization))


def _status(result: Any) -> tuple[str, str]:
    record = next(p for p in result.passes if p.name == "quantize")
    return record.status, record.detail


@pytest.fixture
def cpu_is(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """The host CPU's flags, as torch.cpu.get_capabilities reports them, set to those of a
    CPU in test_cpu_isa.CPUINFO (the CPU plugin's probe seam reads them there). Unlike
    that file's /proc/cpuinfo fixture it keeps get_capabilities: torch and torchao call
    it while quantizing."""
    def use(cpu: str) -> None:
        flags = {canonical_flag(f): True for f in CPUINFO[cpu].split()}
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags, raising=False)
        host.cpu_flags.cache_clear()
    yield use
    host.cpu_flags.cache_clear()


@pytest.fixture
def vnni(cpu_is: Callable[[str], None]) -> None:
    cpu_is("Zen 4")  # AVX512-VNNI and AVX512-BF16, no AMX


@needs_torchao
def test_int8_applied_with_the_gate_figures_in_the_report(vnni: None) -> None:
    model, x = _mlp(), _sample()
    result = _backend().optimize(model, "O1", sample_input=x, quantize="int8")
    assert _status(result)[0] == "applied"
    from torchao.utils import TorchAOBaseTensor

    assert all(isinstance(m.weight, TorchAOBaseTensor)
               for m in result.model.modules() if isinstance(m, nn.Linear))
    assert not any(isinstance(m.weight, TorchAOBaseTensor)  # the caller's model untouched
                   for m in model.modules() if isinstance(m, nn.Linear))
    outcome = result.quantization_outcome()
    assert outcome["mode"] == "int8" and outcome["status"] == "applied"
    assert "Int8DynamicActivationInt8WeightConfig on 3 of 3 Linear" in outcome["detail"]
    assert 0.99 <= outcome["cosine"] <= 1.0 and 0.9 <= outcome["argmax_agreement"] <= 1.0
    summary = result.summary()
    assert "quantization: int8 applied" in summary
    assert f"cosine {outcome['cosine']:.4f}" in summary and "argmax agreement" in summary
    assert result.to_dict()["quantization"] == outcome
    with torch.no_grad():  # the returned model computes in int8: close, not equal
        cosine, _ = accuracy(model(x), result.model(x))
    assert cosine == pytest.approx(outcome["cosine"])


def _prepared_times_faster(label: str, fn: Callable[[], Any]) -> float:
    fn()  # the keep-the-faster timing (optimize/fastest.py) answered without a clock
    return {"O0": 3.0, "prepared": 1.0, "uncompiled": 2.0}[label]


@needs_torchao
@pytest.mark.parametrize("how", ["prune", "weight_norm"])
def test_a_linear_whose_weight_is_computed_at_each_call_stays_in_float(
        vnni: None, how: str) -> None:
    """Pruning and weight_norm compute the weight at each call from other parameters:
    torchao's quantized weight cannot stand in for it. Before: the pass failed whole on
    TypeError "cannot assign 'torch.FloatTensor' as parameter 'weight'" (KeyError for
    weight_norm), the other layers unquantized."""
    from torch.nn.utils import parametrizations, prune
    from torchao.utils import TorchAOBaseTensor

    model = _mlp()
    with torch.no_grad():  # else pruning's weight is no leaf, and the model cannot be copied
        if how == "prune":
            prune.l1_unstructured(model[2], "weight", amount=0.5)
        else:
            parametrizations.weight_norm(model[2])
    result = _backend().optimize(model, "O1", sample_input=_sample(), quantize="int8")
    assert _status(result)[0] == "applied"
    quantized = [isinstance(m.weight, TorchAOBaseTensor) for m in result.model.modules()
                 if isinstance(m, nn.Linear)]
    assert quantized == [True, False, True]
    assert any("1 Linear layer(s) kept in float, their weight computed at each call" in n
               and n.endswith(": 2") for n in result.notes), result.notes
    with torch.no_grad():
        for layer in (0, 4):
            if how == "prune":
                prune.l1_unstructured(model[layer], "weight", amount=0.5)
            else:
                parametrizations.weight_norm(model[layer])
    result = _backend().optimize(model, "O1", sample_input=_sample(), quantize="int8")
    assert _status(result) == ("skipped", "int8: every nn.Linear computes its weight at each "
                               "call (pruning, weight_norm or a parametrization): 0, 2, 4")


@needs_torchao
@pytest.mark.parametrize("mode", ["int8", "int8_weight_only"])
def test_o3_quantizes_and_compiles_under_the_gate(vnni: None, mode: str) -> None:
    # The whole O3 sequence: autocast and bf16 weights (not with int8 on a CPU: its int8
    # GEMMs take float32 activations), then quantize, then compile with freezing; the
    # passes after quantize are checked with its gate, not O3's tolerance, and the final
    # check against O0 (float32) too.
    from torchbridge.optimize.pipeline import run_pipeline

    model, x = _mlp(), _sample()
    result = run_pipeline(_backend(), model, "O3", sample_input=x, quantize=mode,
                          timer=_prepared_times_faster)
    report = {p.name: (p.status, p.detail) for p in result.passes}
    low_precision = ("autocast", "low_precision_weights")
    for name in (*(low_precision if mode != "int8" else ()), "quantize", "compile"):
        assert report[name][0] == "applied", result.summary()
    if mode == "int8":  # an MLP: its Linears are all of its work
        assert report["autocast"] == (
            "skipped", "quantize='int8' on a CPU, and nn.Linear does 100% of the model's "
            "matmul FLOPs on the sample input: the int8 GEMMs take float32 activations "
            "(faster here than bf16 around them)")
    outcome = result.quantization_outcome()
    assert outcome["status"] == "applied" and outcome["cosine"] >= 0.99
    with torch.no_grad():
        cosine, agreement = accuracy(model(x), result.model(x))
    assert cosine >= 0.99 and agreement is not None and agreement >= 0.9


@needs_torchao
@pytest.mark.parametrize("cpu", ["Zen 4", "Sapphire Rapids", "Granite Rapids"])
def test_int8_keeps_bf16_around_its_gemms_where_amx_computes_bf16(
        cpu_is: Callable[[str], None], cpu: str) -> None:
    # The MLP's Linears are all of its work: without AMX its int8 GEMMs take float32
    # activations; on AMX tiles bf16 around them was faster for every model measured,
    # Linear-only ones included (quantize.py, 2026-11-27).
    from torchbridge.optimize.pipeline import run_pipeline

    cpu_is(cpu)
    model, x = _mlp(), _sample()
    result = run_pipeline(_backend(disabled_passes=["compile"]), model, "O3", sample_input=x,
                          quantize="int8", timer=_prepared_times_faster)
    report = {p.name: (p.status, p.detail) for p in result.passes}
    assert report["quantize"][0] == "applied", result.summary()
    amx = "autocast: kept with quantize='int8': this CPU computes bf16 matmuls on AMX tiles"
    if cpu == "Zen 4":
        assert report["autocast"][0] == "skipped"
        assert "nn.Linear does 100% of the model's matmul FLOPs" in report["autocast"][1]
        assert not any(note.startswith(amx) for note in result.notes)
    else:
        assert report["autocast"][0] == "applied", result.summary()
        assert report["low_precision_weights"][0] == "applied", result.summary()
        assert any(note.startswith(amx) for note in result.notes), result.notes
    with torch.no_grad():
        cosine, agreement = accuracy(model(x), result.model(x))
    assert cosine >= 0.99 and agreement is not None and agreement >= 0.9


@needs_torchao
@pytest.mark.parametrize("inplace", [False, True])
def test_a_quantization_that_breaks_the_model_is_rolled_back(
        vnni: None, monkeypatch: pytest.MonkeyPatch, inplace: bool) -> None:
    import torchao.quantization

    real = torchao.quantization.quantize_

    def zeroing(model: nn.Module, config: Any, *args: Any, **kwargs: Any) -> None:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.data.zero_()  # a broken quantizer: every weight lost
        real(model, config, *args, **kwargs)

    monkeypatch.setattr(torchao.quantization, "quantize_", zeroing)
    model, x = _mlp(), _sample()
    weights = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    with torch.no_grad():
        expected = model(x)
    result = _backend().optimize(model, "O1", sample_input=x, quantize="int8",
                                 inplace=inplace)
    status, detail = _status(result)
    assert status == "failed"
    assert detail.startswith("quantization int8 rolled back: cosine ")
    assert "< 0.99" in detail and "argmax agreement" in detail and "< 90%" in detail
    outcome = result.quantization_outcome()
    assert outcome["status"] == "rolled back" and outcome["detail"] == detail
    assert detail in result.summary()
    with torch.no_grad():
        assert torch.equal(result.model(x), expected)
    if inplace:  # the caller's own model, its own parameters, as they were
        assert result.model is model
        for name, p in model.named_parameters():
            assert p is weights[name][0] and torch.equal(p, weights[name][1])


@needs_torchao
def test_min_cosine_from_config_rolls_back_a_close_quantization(vnni: None) -> None:
    model, x = _mlp(), _sample()
    result = _backend(quantize_min_cosine=1.0).optimize(model, "O1", sample_input=x,
                                                        quantize="int8")
    status, detail = _status(result)
    assert status == "failed" and "cosine 0.99" in detail and "< 1" in detail
    # Both figures, the one that failed with its threshold.
    assert "argmax agreement" in detail and "% <" not in detail
    with torch.no_grad():
        assert torch.equal(result.model(x), model(x))


@needs_torchao
def test_config_quantize_is_honoured_and_quantize_false_overrides_it(vnni: None) -> None:
    backend = _backend(quantize="int8")
    assert _status(backend.optimize(_mlp(), "O1", sample_input=_sample()))[0] == "applied"
    result = backend.optimize(_mlp(), "O1", sample_input=_sample(), quantize=False)
    assert _status(result)[0] == "skipped" and result.quantization_outcome() is None
    assert "quantization:" not in result.summary()


def test_unknown_mode_is_a_configuration_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigurationError, match="did you mean 'int8_weight_only'"):
        _backend().optimize(_mlp(), "O1", sample_input=_sample(), quantize="int8_weightonly")


def _skip_reason(**kwargs: Any) -> str:
    kwargs.setdefault("sample_input", _sample())
    result = _backend().optimize(kwargs.pop("model", _mlp()), "O1", **kwargs)
    status, detail = _status(result)
    assert status == "skipped"
    outcome = result.quantization_outcome()
    assert outcome["status"] == "skipped" and outcome["detail"] == detail
    assert f"quantization: {outcome['mode']} skipped" in result.summary()
    return detail


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)).eval()


@needs_torchao
def test_int8_keeps_autocast_where_the_linears_are_a_small_part(vnni: None) -> None:
    # A conv net with a Linear head: int8 takes the head, the convolutions run faster in
    # bf16 (ResNet-18-like: 2.05x eager with autocast against 1.49x without, quantize.py).
    x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    result = _backend(disabled_passes=["compile"]).optimize(
        _conv_net(), "O3", sample_input=x, quantize="int8")
    report = {p.name: p.status for p in result.passes}
    assert report["autocast"] == report["quantize"] == "applied", result.summary()
    note = next(n for n in result.notes if n.startswith("autocast: kept with quantize"))
    assert "nn.Linear does only 0% of the model's matmul FLOPs" in note


@pytest.mark.parametrize("why", ["no sample input", "no torchao", "training", "disabled"])
def test_int8_that_will_not_run_leaves_autocast_on(
        vnni: None, monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    # Float32 activations are for int8's GEMMs: with the quantize pass skipped, the model
    # computes in bf16 as O2 gives it without quantize=.
    if why == "no torchao":
        for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao: ImportError
    model = _mlp().train() if why == "training" else _mlp()
    disabled = ["compile", *(["quantize"] if why == "disabled" else [])]
    result = _backend(disabled_passes=disabled).optimize(
        model, "O2", sample_input=None if why == "no sample input" else _sample(),
        quantize="int8")
    report = {p.name: p.status for p in result.passes}
    assert report["quantize"] == "skipped" and report["autocast"] == "applied", \
        result.summary()


def test_linear_flop_share_counts_linears_against_every_matmul_and_conv() -> None:
    from torchbridge.optimize.passes import PassContext
    from torchbridge.optimize.quantize import linear_flop_share

    backend = _backend()
    ctx = PassContext(backend, torchbridge.OptimizationLevel.O3, backend.config,
                      backend.get_device_info(), training=False,
                      sample_input=torch.randn(4, 3, 16, 16))
    model = _conv_net()
    share = linear_flop_share(model, ctx)
    linear = 2 * 4 * 32 * 10
    convs = 2 * 4 * 16 * 16 * 32 * (3 * 9 + 32 * 9)
    assert share == pytest.approx(linear / (linear + convs))
    ctx.sample_input = _sample()
    assert linear_flop_share(_mlp(), ctx) == 1.0
    ctx.sample_input = torch.randn(4, 5)  # the model cannot run it: no figure
    assert linear_flop_share(_mlp(), ctx) is None
    assert not model.training and all(h == {} for h in (
        m._forward_hooks for m in model.modules()))


def test_int8_is_skipped_on_a_cpu_without_vnni(cpu_is: Callable[[str], None]) -> None:
    cpu_is("Zen 3")  # AVX2 only
    assert "no int8 dot-product instructions (VNNI" in _skip_reason(quantize="int8")


@needs_torchao
def test_int8_weight_only_needs_no_vnni(cpu_is: Callable[[str], None]) -> None:
    cpu_is("Zen 3")  # its weights are widened to float inside the matmul: no int8 math
    result = _backend().optimize(_mlp(), "O1", sample_input=_sample(),
                                 quantize="int8_weight_only")
    outcome = result.quantization_outcome()
    assert outcome["status"] == "applied", result.summary()
    assert "Int8WeightOnlyConfig" in outcome["detail"] and outcome["cosine"] >= 0.99


@pytest.mark.parametrize("mode", ["int4_weight_only", "float8"])
def test_int4_and_float8_are_skipped_on_cpu(vnni: None, mode: str) -> None:
    assert f"torchao 0.18 has no CPU kernel for {mode}" in _skip_reason(quantize=mode)


def test_skipped_without_torchao(vnni: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao: ImportError
    assert "pip install torchbridge-core[quantize]" in _skip_reason(quantize="int8")


def test_skipped_without_a_sample_input(vnni: None) -> None:
    reason = _skip_reason(quantize="int8", sample_input=None)
    assert "needs sample_input to check the quantized model's accuracy" in reason


def test_skipped_in_training_mode(vnni: None) -> None:
    assert "training mode" in _skip_reason(quantize="int8", model=_mlp().train())


def test_skipped_without_linear_layers(vnni: None) -> None:
    model = nn.Sequential(nn.GELU()).eval()
    assert "no nn.Linear" in _skip_reason(quantize="int8", model=model)


# -- the gate's figures and the support table, without torchao -----------------------------

def test_accuracy_figures() -> None:
    reference = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    assert accuracy(reference, reference.clone()) == (pytest.approx(1.0), 1.0)
    swapped = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]])  # row 2's argmax moves
    cosine, agreement = accuracy(reference, swapped)
    assert cosine == pytest.approx(1 / 5) and agreement == 0.5
    # every floating tensor of the output counts; integer ones and last dims of 1 do not
    out = {"logits": reference, "ids": torch.tensor([1, 2]), "score": torch.ones(2, 1)}
    assert accuracy(out, {**out, "logits": swapped})[1] == 0.5
    assert accuracy(torch.ones(4, 1), torch.ones(4, 1)) == (pytest.approx(1.0), None)
    with pytest.raises(ValueError, match="do not match"):
        accuracy(reference, reference[:1])


def test_the_cosine_is_the_lowest_of_the_outputs() -> None:
    # A small output ruined beside a large one: joined into one vector, the large one hid
    # it (cosine 0.99997 for a pair whose second output had cosine 0.3).
    big, small = torch.full((8, 1), 1000.0), torch.linspace(1.0, 2.0, 8).unsqueeze(1)
    cosine, agreement = accuracy((big, small), (big, small.flip(0) - 1.5))
    assert cosine < 0.5 and agreement is None
    assert accuracy((big, small), (big, small))[0] == pytest.approx(1.0)


def test_an_output_of_zeros_beside_others_does_not_fail_the_cosine() -> None:
    # A zero-initialised head (or a loss of 0): no direction to compare; quantization
    # noise alone gave it cosine 0.
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    noise = torch.full((4, 3), 1e-9)
    assert accuracy((logits, torch.zeros(4, 3)), (logits, noise))[0] == pytest.approx(1.0)
    # Not when the quantized one is no longer small: that output was ruined.
    assert accuracy((logits, torch.zeros(4, 3)), (logits, torch.ones(4, 3)))[0] == 0.0


def test_a_small_output_beside_a_large_one_is_compared_on_its_own() -> None:
    # A regression value at 1e-3 beside logits at 1e4 is an output, not zeros: it was
    # once left out of the cosine, and a ruined one passed the gate.
    logits = 1e4 * torch.randn(32, 10, generator=torch.Generator().manual_seed(0))
    value = 1e-3 * torch.rand(32, 1, generator=torch.Generator().manual_seed(1)) + 1e-4
    ruined = value.flip(0)
    cosine, agreement = accuracy((logits, value), (logits, ruined))
    assert cosine == pytest.approx(torch.nn.functional.cosine_similarity(
        value.flatten().double(), ruined.flatten().double(), dim=0).item(), abs=1e-6)
    assert cosine < 0.99 and agreement == 1.0
    assert accuracy((logits, value), (logits, value.clone()))[0] == pytest.approx(1.0)


def test_a_nan_the_reference_does_not_have_fails_the_cosine() -> None:
    # max(-1, min(1, nan)) is 1.0 in Python: the gate once passed a NaN output as cosine 1.
    reference = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    broken = reference.clone()
    broken[0, 0] = float("nan")
    assert math.isnan(accuracy(reference, broken)[0])
    inf = reference.clone()
    inf[1, 1] = float("inf")
    assert math.isnan(accuracy(reference, inf)[0])
    # The same NaN in both (a masked position, say) is left out, as drift leaves it out.
    assert accuracy(broken, broken.clone())[0] == pytest.approx(1.0)


@needs_torchao
def test_a_quantization_that_outputs_nan_is_rolled_back(vnni: None) -> None:
    from torchao.utils import TorchAOBaseTensor

    class NanWhenQuantized(nn.Module):  # one NaN among the outputs once int8 runs it
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x)
            if isinstance(self.linear.weight, TorchAOBaseTensor):
                out = out.clone()
                out[0, 0] = float("nan")
            return out

    torch.manual_seed(0)
    x = torch.randn(32, 16)
    model = NanWhenQuantized().eval()
    result = _backend().optimize(model, "O1", sample_input=x, quantize="int8")
    status, detail = _status(result)
    assert status == "failed" and "rolled back: cosine nan" in detail, detail
    assert not torch.isnan(result.model(x)).any()


@needs_torchao
def test_one_linear_torchao_refuses_keeps_its_float_weight(vnni: None) -> None:
    # torchao raises on nn.Linear(1, 16) and cannot serve `x @ self.weight.T` (a subclass
    # like transformers' FalconLinear): those keep float weights, the others quantize.
    class TransposedLinear(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.T + self.bias

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Linear(1, 64)
            self.up = nn.Linear(64, 128)
            self.odd = TransposedLinear(128, 64)
            self.down = nn.Linear(64, 16)

        def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return self.down(self.odd(torch.relu(self.up(x * self.scale(s)))))

    torch.manual_seed(0)
    model = Mixed().eval()
    sample = (torch.randn(32, 64), torch.randn(32, 1))
    result = _backend().optimize(model, "O1", sample_input=sample, quantize="int8")
    assert _status(result)[0] == "applied", result.summary()
    from torchao.utils import TorchAOBaseTensor

    quantized = {n for n, m in result.model.named_modules()
                 if isinstance(getattr(m, "weight", None), TorchAOBaseTensor)}
    assert quantized == {"up", "down"}
    assert "on 2 of 4 Linear" in result.quantization_outcome()["detail"]
    note = next(n for n in result.notes if "kept in float" in n)
    assert "scale (RuntimeError" in note and "odd (" in note
    torch.testing.assert_close(result.model(*sample), model(*sample), rtol=0.1, atol=0.1)


def _gpu(vendor: str, capability: str, *, dtypes: tuple[str, ...] = ("float32", "bfloat16"),
         architecture: str = "known", **extra: Any) -> DeviceInfo:
    return DeviceInfo(name=f"{vendor} GPU", backend="cuda", memory_total_gb=80.0,
                      memory_available_gb=80.0, compute_capability=capability,
                      supported_dtypes=list(dtypes), vendor=vendor, architecture=architecture,
                      extra=extra)


FP8 = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def test_where_each_mode_runs_on_gpus() -> None:
    a100 = _gpu("NVIDIA", "8.0")
    l4, h100 = _gpu("NVIDIA", "8.9", dtypes=FP8), _gpu("NVIDIA", "9.0", dtypes=FP8)
    assert "8.9 or newer" in (unsupported("float8", a100, "cuda") or "")
    assert unsupported("float8", l4, "cuda") is None and \
        unsupported("float8", h100, "cuda") is None
    assert all(unsupported(m, a100, "cuda") is None
               for m in ("int8", "int8_weight_only", "int4_weight_only"))
    assert "8.0 or newer" in (unsupported("int8", _gpu("NVIDIA", "7.5"), "cuda") or "")
    mi250 = _gpu("AMD", "gfx90a")
    mi300 = _gpu("AMD", "gfx942", dtypes=("float32", "bfloat16", "float8_e4m3fnuz"),
                 gcn_arch_name="gfx942:sramecc+")
    assert "MI300" in (unsupported("float8", mi250, "cuda") or "")
    assert unsupported("float8", mi300, "cuda") is None
    assert unsupported("int4_weight_only", mi250, "cuda") is None
    assert "no XMX" in (unsupported("int8", _gpu("Intel", "12.0", xmx=False), "xpu") or "")
    assert unsupported("float8", _gpu("Intel", "12.60", xmx=True), "xpu") is None
    assert "no int8 kernels for xla" in (unsupported("int8", h100, "xla") or "")


def test_a_gpu_the_plugin_does_not_know_gets_no_float8_or_int4_assumed() -> None:
    # A compute capability outside the NVIDIA plugin's table is described with float32
    # only, and its fp8_linear pass and autocast assume nothing: the gate agrees with
    # them instead of comparing capabilities (it said float8 ran on 13.0).
    future = _gpu("NVIDIA", "13.0", dtypes=("float32",), architecture="unknown")
    assert "lists no float8 dtype" in (unsupported("float8", future, "cuda") or "")
    assert "bfloat16" in (unsupported("int4_weight_only", future, "cuda") or "")
    assert unsupported("int8", future, "cuda") is None
    # An AMD architecture whose description lists no FP8 dtype is refused the same way,
    # whatever torchao's own list of architectures says.
    gfx940 = _gpu("AMD", "gfx940", gcn_arch_name="gfx940")  # torchao lists it
    assert "lists no float8 dtype" in (unsupported("float8", gfx940, "cuda") or "")


@needs_torchao
def test_linears_tied_to_one_weight_share_one_quantized_weight() -> None:
    class TiedLinears(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = TiedLinears().eval()
    result = torchbridge.get_backend("cpu").optimize(
        model, "O1", sample_input=torch.randn(16, 32), quantize="int8")
    assert result.quantization_outcome()["status"] == "applied", result.summary()
    q = result.model
    assert q.a.weight is q.b.weight and type(q.a.weight).__name__ != "Parameter"
    assert model.a.weight is model.b.weight  # the caller's model keeps its own tie


@needs_torchao
def test_a_quantized_checkpoint_loaded_with_a_dtype_is_refused(tmp_path: Any) -> None:
    """torchao's weights keep their dtype under .to(dtype): cast silently, half the
    checkpoint would have come back in another dtype than asked."""
    result = torchbridge.get_backend("cpu").optimize(
        _mlp(), "O1", sample_input=_sample(), quantize="int8")
    assert result.quantization_outcome()["status"] == "applied", result.summary()
    torchbridge.save_checkpoint(result.model, tmp_path / "q.pt")
    with pytest.raises(torchbridge.CheckpointError, match="without dtype="):
        torchbridge.load_checkpoint(tmp_path / "q.pt", dtype=torch.bfloat16)
    state = torchbridge.load_checkpoint(tmp_path / "q.pt")
    assert state.keys() == result.model.state_dict().keys()
